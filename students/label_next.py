"""``toolchain label-next RECIPE --n N``: which pool images, labeled next, would help most.

After a build, the store holds a finetuned teacher, its distilled student and the pool's embeddings.  Every pool
image gets a score from three documented parts, and N images are chosen from the best-scoring ones:

* **uncertainty** of the teacher, in [0, 1]: classification ``margin`` (1 - (p1 - p2), the default) or
  ``entropy`` (H(p) / log C); segmentation: the same per pixel, averaged over the image; detection: over the
  teacher's boxes, the largest binary entropy of a box's score (a box at 0.5 is as unsure as a box can be;
  an image with one ambiguous object is worth a label).
* **disagreement** of teacher and student, in [0, 1]: the Jensen-Shannon divergence (base 2) of their class
  probabilities, per pixel and averaged for segmentation; detection: 1 - F1 of the student's boxes matched to the
  teacher's (same class, IoU >= 0.5), both at ``box_threshold``.  Where the student has not learnt what the
  teacher knows, a label teaches both.
* **typicality**, in [0, 1]: how dense the pool is around the image, as a percentile over the pool: the inverse
  mean distance to its ``typicality_k`` nearest pool images in the curation's embeddings (TypiClust's
  typicality, Hacohen et al. 2022, "Active learning on a budget"), measured against at most 20,000 pool images
  drawn at random, so a web-scale pool costs N x 20,000 distances.  With a few labels per class the most
  uncertain images are outliers and odd views whose label teaches little; a typical image that the teacher is
  still unsure of stands for many.  On CIFAR-10 (25 -> 35 labels per class, a linear probe on the teacher's
  frozen features as a quick proxy, 10 seeds; docs/results.md) uncertainty alone chose worse than random and
  half typicality, half uncertainty better.
* **value** = ``w_uncertainty`` x uncertainty + ``w_disagreement`` x disagreement + ``w_typicality`` x
  typicality.

Selection is k-center greedy over the curation's embeddings (the retrieval encoder's, already in the store),
weighted by value and balanced over the classes the teacher sees: the ``candidates`` x N images of highest value
compete; each pick goes to the class seen in the fewest labeled and already chosen images, and within it to the
image of largest value x diversity (diversity: distance to the nearest labeled or already chosen image, / 2, so in
[0, 1]).  An image within ``dedup_distance`` of a labeled or chosen image is a near-duplicate and never chosen.
The classes an image shows are the teacher's, by one measure for the pool and the labeled images: classification
its predicted class; segmentation every class on at least ``min_share`` of the image's pixels; detection the class
of every box at ``box_threshold``.  A scene has several classes, and a rare one (Stanford Background's mountain,
water or grass, each a few percent of its pixels) is seldom any image's largest: balancing over
the largest class alone would spend the labels on the classes the labeled set already shows most.

Writes ``label_next.csv`` (every scored image: rank, status, value and its parts, predicted class, classes seen),
``contact_sheet.png`` (the chosen images in rank order) and ``to_label/`` (the chosen images, copied with their
rank in front of the name, and ``images.csv`` naming where each came from): a folder to hand to a labeling tool.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes, place_file
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.study import SELECTIONS
from vfm_toolchain.tasks import task_of
from vfm_toolchain.teachers.strategies.base import knn
from vfm_toolchain.teachers.vectors import PoolVectors

__all__ = ["classification_parts", "segmentation_parts", "detection_parts", "pixel_shares", "choose", "label_next"]

log = logging.getLogger("toolchain")

UNCERTAINTY = ("margin", "entropy")


# ---------------------------------------------------------------------------------------------------------------
# the parts of the score, per task (torch in, numpy out; probabilities on the class axis 1)


def _uncertainty(p: torch.Tensor, measure: str) -> torch.Tensor:
    """Per row (and pixel) of class probabilities ``p`` [B, C, ...]: 1 - margin, or normalised entropy."""
    if measure == "entropy":
        return -(p * p.clamp_min(1e-12).log()).sum(1) / math.log(p.shape[1])
    top = p.topk(2, dim=1).values
    return 1 - (top[:, 0] - top[:, 1])


def _js(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence, base 2 (in [0, 1]), over the class axis 1."""
    m = (p + q) / 2
    kl = lambda a: (a * (a.clamp_min(1e-12) / m.clamp_min(1e-12)).log2()).sum(1)
    return ((kl(p) + kl(q)) / 2).clamp(0, 1)


def classification_parts(teacher: torch.Tensor, student: torch.Tensor, measure: str = "margin"):
    """(uncertainty, disagreement, predicted class) of a batch of class probabilities [B, C]."""
    return (_uncertainty(teacher, measure).numpy(), _js(teacher, student).numpy(),
            teacher.argmax(1).numpy())


def pixel_shares(teacher: torch.Tensor) -> torch.Tensor:
    """[B, C]: the share of each image's pixels the teacher gives each class (its argmax per pixel)."""
    pred = teacher.argmax(1).flatten(1)
    counts = torch.zeros(teacher.shape[0], teacher.shape[1]).scatter_add_(1, pred, torch.ones_like(pred,
                                                                                      dtype=torch.float))
    return counts / pred.shape[1]


def segmentation_parts(teacher: torch.Tensor, student: torch.Tensor, measure: str = "margin"):
    """The same per pixel, averaged over each image; the student's map is resized to the teacher's.  The predicted
    class is the one the teacher gives most pixels."""
    if student.shape[-2:] != teacher.shape[-2:]:
        student = torch.nn.functional.interpolate(student, size=teacher.shape[-2:], mode="bilinear",
                                                  align_corners=False)
    return (_uncertainty(teacher, measure).flatten(1).mean(1).numpy(), _js(teacher, student).flatten(1).mean(1).numpy(),
            pixel_shares(teacher).argmax(1).numpy())


def _box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from torchvision.ops import box_iou

    return box_iou(a, b) if len(a) and len(b) else torch.zeros(len(a), len(b))


def detection_parts(teacher: Sequence[Dict[str, torch.Tensor]], student: Sequence[Dict[str, torch.Tensor]],
                    box_threshold: float = 0.3):
    """Per image of a batch of detections (boxes in one coordinate frame): the largest binary entropy of a teacher
    box's score, 1 - F1 of the student's boxes against the teacher's at ``box_threshold`` (greedy, best score
    first, same class, IoU >= 0.5; both empty: 0), and the class of the teacher's best box (-1: no box)."""
    u, d, pred = [], [], []
    for t, s in zip(teacher, student):
        sc = t["scores"].clamp(1e-6, 1 - 1e-6)
        h = -(sc * sc.log2() + (1 - sc) * (1 - sc).log2())
        u.append(float(h.max()) if len(h) else 0.0)
        pred.append(int(t["labels"][t["scores"].argmax()]) if len(sc) else -1)
        tk, sk = t["scores"] >= box_threshold, s["scores"] >= box_threshold
        tb, tl, sb, sl = t["boxes"][tk], t["labels"][tk], s["boxes"][sk], s["labels"][sk]
        if not len(tb) and not len(sb):
            d.append(0.0)
            continue
        iou = _box_iou(sb, tb) * (sl[:, None] == tl[None, :])
        taken, matched = torch.zeros(len(tb), dtype=torch.bool), 0
        for i in torch.argsort(s["scores"][sk], descending=True).tolist():
            if not len(tb):
                break
            row = iou[i].masked_fill(taken, -1)
            j = int(row.argmax())
            if row[j] >= 0.5:
                taken[j], matched = True, matched + 1
        d.append(1 - 2 * matched / (len(tb) + len(sb)))
    return np.asarray(u, dtype=np.float32), np.asarray(d, dtype=np.float32), np.asarray(pred, dtype=np.int64)


def typicality(vectors: PoolVectors, k: int = 20, reference: int = 20000, seed: int = 0) -> np.ndarray:
    """[N] percentile (0: the sparsest, 1: the densest) of each pool image's density, 1 / mean distance to its
    ``k`` nearest pool images other than itself, found among at most ``reference`` pool images drawn at random
    (every image of a smaller pool)."""
    count = len(vectors)
    if count < 2:
        return np.ones(count, dtype=np.float32)
    ref_ids = np.arange(count) if count <= reference else np.sort(
        np.random.default_rng(seed).choice(count, reference, replace=False))
    ref = vectors.take(ref_ids)
    k = min(k, len(ref_ids) - 1)
    spread = np.empty(count, dtype=np.float64)
    for ids, block in vectors.chunks():
        d, nn = knn(ref, block, k + 1)
        d[ref_ids[nn] == ids[:, None]] = np.inf  # an image is not its own neighbour
        spread[ids] = np.sort(d, axis=1)[:, :k].mean(1)
    order = np.argsort(-spread, kind="stable")  # sparsest first
    pct = np.empty(count, dtype=np.float32)
    pct[order] = np.arange(count, dtype=np.float32) / (count - 1)
    return pct


# ---------------------------------------------------------------------------------------------------------------
# the choice


def choose(value: np.ndarray, predicted: np.ndarray, embeddings: PoolVectors, labeled: Optional[np.ndarray], n: int,
           candidates: int = 10, dedup_distance: float = 0.05, seen: Optional[np.ndarray] = None,
           have: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """Balanced, value-weighted k-center greedy (module docstring).

    Args:
        value: [N] the score of each image; predicted: [N] the teacher's class (-1: none).
        embeddings: the N images' unit vectors (the curation's memory-mapped shards: only the candidates' rows are
            read); labeled: [L, D] those of the labeled images (or None).
        n: images to choose; candidates: the best ``candidates * n`` by value compete.
        seen: [N, C] bool, the classes the teacher sees in each image (students/tasks/ ``classes_seen``); None: the
            predicted class alone.  The images that show none (detection: no box) are a bucket of their own that takes turns
            with the rarest class, not ahead of it (a labeled set rarely has an image the teacher sees nothing in).
        have: [C] how many labeled images show each class, by the same measure; None: none yet.
        An image of non-finite value (unreadable) is never chosen.

    Returns:
        ``rank`` [N] (1..n for the chosen, 0 otherwise), ``status`` [N] (chosen, candidate, near-duplicate,
        scored: below the candidates), ``diversity`` [N] (at the pick for the chosen, else at the end).
    """
    count = len(value)
    rank = np.zeros(count, dtype=np.int64)
    status = np.full(count, "scored", dtype=object)
    pool = np.argsort(-value, kind="stable")[:max(n, candidates * n)]
    status[pool] = "candidate"
    emb = embeddings.take(pool)
    if seen is None:  # the predicted class alone; -1 (nothing predicted) is the last column, the none bucket
        width = int(predicted.max()) + 1 if len(predicted) else 0
        seen = np.zeros((count, width), dtype=bool)
        seen[predicted >= 0, predicted[predicted >= 0]] = True
    shows = np.concatenate([seen[pool], ~seen[pool].any(1, keepdims=True)], axis=1)
    counts = np.zeros(shows.shape[1], dtype=np.int64)  # labeled and chosen images showing each class (last: none)
    if have is not None and len(have):
        counts[:len(have)] = have
        counts[-1] = min(have)
    nearest = np.full(len(pool), 2.0, dtype=np.float32)  # the farthest two unit vectors can be
    if labeled is not None and len(labeled):
        nearest = np.minimum(nearest, knn(np.asarray(labeled, dtype=np.float32), emb, 1)[0][:, 0])
    diversity = np.full(count, np.nan, dtype=np.float32)
    open_ = nearest > dedup_distance
    status[pool[~open_]] = "near-duplicate"
    open_ &= np.isfinite(value[pool])
    for r in range(1, n + 1):
        if not open_.any():
            break
        buckets = np.flatnonzero(shows[open_].any(0))
        # the class the fewest labeled and chosen images show; among equals, the one whose best pick is worth most
        gain = value[pool] * nearest / 2
        best = {b: gain[open_ & shows[:, b]].max() for b in buckets}
        b = min(buckets, key=lambda c: (counts[c], -best[c]))
        mine = np.flatnonzero(open_ & shows[:, b])
        k = mine[np.argmax(gain[mine])]
        rank[pool[k]], status[pool[k]], diversity[pool[k]] = r, "chosen", nearest[k] / 2
        counts += shows[k]
        open_[k] = False
        d = np.linalg.norm(emb - emb[k], axis=1)
        nearest = np.minimum(nearest, d)
        dup = open_ & (d <= dedup_distance)
        status[pool[dup]] = "near-duplicate"
        open_ &= ~dup
    rest = status[pool] != "chosen"
    diversity[pool[rest]] = nearest[rest] / 2
    return {"rank": rank, "status": status, "diversity": diversity}


# ---------------------------------------------------------------------------------------------------------------
# the command


def label_next(recipe, n: int, out: Path, store_root: Path, uncertainty: str = "margin",
               w_uncertainty: float = 0.25, w_disagreement: float = 0.25, w_typicality: float = 0.5,
               candidates: int = 10, box_threshold: float = 0.3, typicality_k: int = 20, min_share: float = 0.02,
               batch_size: int = 32) -> Dict[str, Any]:
    """Rank RECIPE's pool after its build (the stages up to student.finetune, reused from the store or built now)
    and write the three outputs into ``out``; returns a summary."""
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.pool_predict import predict_pool
    from vfm_toolchain.prepare import load_index, sample_paths
    from vfm_toolchain.runner import build
    from vfm_toolchain.stage import StageOutput
    from vfm_toolchain.teachers.curate import stored_pool_vectors

    if n < 1:
        raise ToolchainError(f"--n {n}: the number of images to choose must be at least 1")
    if uncertainty not in UNCERTAINTY:
        raise ToolchainError(f"--uncertainty '{uncertainty}' is not one of {', '.join(UNCERTAINTY)}")
    weights = (w_uncertainty, w_disagreement, w_typicality)
    if min(weights) < 0 or sum(weights) <= 0:
        raise ToolchainError(f"the score weights (uncertainty, disagreement, typicality) must be >= 0 and not all 0, "
                             f"got {weights} (the default: --weights 0.25,0.25,0.5)")
    if typicality_k < 1:
        raise ToolchainError(f"--typicality-k {typicality_k}: the neighbours a density is measured over must be "
                             f"at least 1 (the default: 20)")
    if not 0 < min_share <= 1:
        raise ToolchainError(f"--min-share {min_share}: the share of an image's pixels a class must cover to count "
                             f"as shown is in (0, 1] (the default: 0.02)")
    out = Path(out)
    log.info("label-next: the build's teacher, student and pool embeddings (from the store; a stage not built yet "
             "is built now)")
    build(recipe, out / "build", store_root, only=["student.finetune"])
    stages = {}
    for name in ("data.prepare", "teacher.finetune", "teacher.curate", "student.finetune"):
        folder = out / "build" / "stages" / name
        stages[name] = StageOutput(name, "", folder.resolve(), json.loads((folder / "result.json").read_text()))
    index = load_index(stages["data.prepare"])
    pool, task, classes = index["pool"], task_of(index).name, index["classes"]
    if not pool:
        raise ToolchainError("the data index has no pool images: data.pools lists the unlabeled images to rank")

    def loaded(stage):
        folder = stages[stage].path("model")
        spec = json.loads((folder / "spec.json").read_text())
        return load_model(folder), Preprocess.from_dict(spec["preprocess"])

    teacher, student = loaded("teacher.finetune"), loaded("student.finetune")
    u = np.zeros(len(pool), dtype=np.float32)
    d, pred = np.zeros_like(u), np.full(len(pool), -1, dtype=np.int64)
    seen = np.zeros((len(pool), len(classes)), dtype=bool)
    part = student_task(task)
    unreadable = 0
    for pos, _, ok, (t_out, s_out) in predict_pool([teacher, student], pool, task, batch_size,
                                                   what="pool images (teacher and student)"):
        u[pos], d[pos], pred[pos] = part.label_next_parts(t_out, s_out, uncertainty, box_threshold)
        seen[pos] = part.classes_seen(t_out, len(classes), box_threshold, min_share)
        unreadable += len(ok) - sum(ok)
        for i, good in zip(pos, ok):  # an image that became unreadable is never chosen
            if not good:
                u[i] = d[i] = -1.0
    # the classes the labeled images show, by the teacher as for the pool (one measure): the rarest go first
    have = np.zeros(len(classes), dtype=np.int64)
    for _, _, ok, (t_out,) in predict_pool([teacher], sample_paths(index["train"]), task, batch_size,
                                           what="labeled images (the classes they show)"):
        have += part.classes_seen(t_out, len(classes), box_threshold, min_share)[np.asarray(ok)].sum(0)
    log.info("label-next: labeled images showing each class (the teacher's view): %s",
             dict(zip(classes, have.tolist())))
    vectors = stored_pool_vectors(stages["teacher.curate"], stages["data.prepare"])
    # not measured when it does not count (it is the one part that grows with the pool squared): blank in the csv
    if w_typicality:
        log.info("label-next: typicality of %d pool images (mean distance to the %d nearest of at most 20,000)",
                 len(vectors), typicality_k)
    t = typicality(vectors, typicality_k, seed=recipe.seed) if w_typicality else np.full_like(u, np.nan)
    value = w_uncertainty * u + w_disagreement * d + w_typicality * np.nan_to_num(t)
    value[u < 0] = -np.inf
    q = stages["teacher.curate"].dir / "query_emb.npy"
    labeled = np.load(q, mmap_mode="r") if q.is_file() else None
    if labeled is None or len(labeled) != len(index["train"]):  # text queries, or detection's object crops only
        labeled = None
        log.warning("label-next: no embeddings of the labeled images in the curation (text queries, or detection's "
                    "object crops only); diversity starts from the chosen images only")
    dedup = recipe.curate.dedup_distance if recipe.curate.dedup_distance is not None else 0.0
    picked = choose(value, pred, vectors, labeled, n, candidates, dedup, seen=seen, have=have)
    chosen = np.argsort(np.where(picked["rank"] > 0, picked["rank"], np.iinfo(np.int64).max))[
        :int((picked["rank"] > 0).sum())]
    if len(chosen) < n:
        log.warning("label-next: %d of the %d images asked for could be chosen (the rest of the candidates are "
                    "near-duplicates or unreadable); raise --candidates to look further", len(chosen), n)
    names = lambda c: classes[c] if c >= 0 else "(none)"
    _write_csv(out / "label_next.csv", pool, picked, value, u, d, t, pred, seen, names)
    _contact_sheet(out / "contact_sheet.png", [pool[i] for i in chosen],
                   [f"{k + 1}. {names(pred[i])} {value[i]:.2f}" for k, i in enumerate(chosen)])
    folder = _to_label(out / "to_label", [pool[i] for i in chosen])
    summary = {"chosen": len(chosen), "asked": n, "scored": len(pool), "unreadable": unreadable,
               "weights": {"uncertainty": w_uncertainty, "disagreement": w_disagreement, "typicality": w_typicality},
               "near_duplicates": int((picked["status"] == "near-duplicate").sum()),
               "per_class": {names(c): int((pred[chosen] == c).sum()) for c in np.unique(pred[chosen])},
               "showing": {c: [int(have[i]), int(seen[chosen, i].sum())] for i, c in enumerate(classes)},
               "csv": str(out / "label_next.csv"), "sheet": str(out / "contact_sheet.png"), "folder": str(folder)}
    log.info("label-next: chose %d of %d pool images (per predicted class: %s; images showing each class, "
             "labeled + chosen: %s); %d near-duplicates passed over", len(chosen), len(pool), summary["per_class"],
             {c: f"{a} + {b}" for c, (a, b) in summary["showing"].items()}, summary["near_duplicates"])
    return summary


def _write_csv(path: Path, pool, picked, value, u, d, t, pred, seen, names) -> None:
    """Every pool image: the chosen in rank order, then the rest by value."""
    order = sorted(range(len(pool)), key=lambda i: (picked["rank"][i] == 0, picked["rank"][i], -value[i]))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "path", "status", "score", "uncertainty", "disagreement", "typicality", "diversity",
                "predicted_class", "classes_seen"])
    for i in order:
        unreadable = u[i] < 0
        w.writerow([picked["rank"][i] or "", pool[i], "unreadable" if unreadable else picked["status"][i],
                    "" if unreadable else f"{value[i]:.6f}", "" if unreadable else f"{u[i]:.6f}",
                    "" if unreadable else f"{d[i]:.6f}", "" if np.isnan(t[i]) else f"{t[i]:.6f}",
                    "" if np.isnan(picked["diversity"][i]) else f"{picked['diversity'][i]:.6f}", names(pred[i]),
                    ";".join(names(c) for c in np.flatnonzero(seen[i]))])
    atomic_write_bytes(path, buf.getvalue().encode())


def _contact_sheet(path: Path, paths: List[str], titles: List[str], per_row: int = 8, most: int = 64) -> None:
    """The chosen images in rank order (at most ``most``), each titled rank. class score."""
    from vfm_toolchain.data.images import load_image
    from vfm_toolchain.sheets import Cell, save_sheet

    cells = [Cell(load_image(p), t) for p, t in zip(paths[:most], titles)]
    per_row = max(1, min(per_row, len(cells)))
    save_sheet(path, [cells[i:i + per_row] for i in range(0, len(cells), per_row)],
               f"label next: the {len(cells)} chosen images (rank. predicted class score)", cell=(144, 144))


def _to_label(folder: Path, paths: List[str]) -> Path:
    """The chosen images copied as ``0001_<name>`` (rank order survives any file browser), and images.csv."""
    if folder.exists():
        shutil.rmtree(folder)  # a previous choice: the folder holds this one only
    folder.mkdir(parents=True)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["rank", "file", "source"])
    for k, p in enumerate(paths, 1):
        name = f"{k:04d}_{Path(p).name}"
        place_file(p, folder / name, copy=True)  # copies: the folder is uploaded or moved as it is
        w.writerow([k, name, p])
    atomic_write_bytes(folder / "images.csv", buf.getvalue().encode())
    return folder


@SELECTIONS.register("active")
def _active_choice(pool: List[str], n: int, labeled: set, previous, store_root: Path, folder: Path,
                   seed: str) -> List[str]:
    """The study's active selection: label-next on the previous budget's distilled build (``previous``, its
    recipe), the ``n`` best not labeled yet (images labeled earlier are near-duplicates of the labeled set for
    label-next too; asked for ``n`` more to be sure)."""
    if previous is None:
        raise ToolchainError("study.selection active chooses with label-next, which reads a distilled student: add "
                             "task_oriented (or another distillation method) to study.methods")
    log.info("study: label-next on %s chooses %d pool images to label", previous.name, n)
    label_next(previous, n + len(labeled), folder, store_root)
    with open(folder / "label_next.csv", newline="") as fh:
        ranked = [r["path"] for r in csv.DictReader(fh) if r["rank"]]
    return [p for p in ranked if p not in labeled][:n]
