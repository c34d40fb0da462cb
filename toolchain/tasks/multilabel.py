"""Multi-label classification: several tags per image (data/tags.py reads a ``tags.csv`` or COCO's
image-level tags), one sigmoid per tag, macro mAP.

The main metric is the macro average precision over the tags a split shows (scikit-learn's step-wise AP, the
mean over tags with at least one positive image): it ranks and needs no threshold.  A deployed tagger still needs
one per tag, so every model's scores also carry per-tag thresholds chosen on val (the F1-best of 0.05 ... 0.95)
and the per-tag F1 on test at those thresholds (``<split>_f1_per_tag``, ``test_macro_f1``).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.tasks.base import Splits, Task, artifact_outputs, register_task, save_slice, slice_images

__all__ = ["MultiLabel", "average_precision", "macro_ap", "choose_thresholds", "f1_scores", "multi_hot",
           "add_tag_report"]

THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # the per-tag thresholds tried on val


def multi_hot(items: Sequence[Any], num_classes: int) -> np.ndarray:
    """[N, C] 0/1 float32 targets of ``[path, [tag ids]]`` samples."""
    out = np.zeros((len(items), num_classes), dtype=np.float32)
    for row, (_, tags) in zip(out, items):
        row[list(tags)] = 1.0
    return out


def average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    """Step-wise AP of one tag (scikit-learn's ``average_precision_score``: precision at each distinct score, weighted
    by the recall it adds); NaN without a positive."""
    positive = np.asarray(positive, dtype=bool)
    if not positive.any():
        return float("nan")
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="mergesort")
    s, y = np.asarray(scores, dtype=np.float64)[order], positive[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last row of each run of equal scores
    tp = np.cumsum(y)[last].astype(np.float64)
    precision, recall = tp / (last + 1), tp / tp[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def macro_ap(probs: np.ndarray, targets: np.ndarray) -> float:
    """The mean AP over the tags with at least one positive; NaN when none has."""
    aps = [average_precision(probs[:, c], targets[:, c]) for c in range(targets.shape[1])]
    aps = [a for a in aps if a == a]
    return float(np.mean(aps)) if aps else float("nan")


def f1_scores(probs: np.ndarray, targets: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """Per-tag F1 of ``probs >= thresholds`` (a tag neither predicted nor present: 1)."""
    pred = probs >= np.asarray(thresholds)[None, :]
    y = targets > 0.5
    tp = (pred & y).sum(0).astype(np.float64)
    denom = pred.sum(0) + y.sum(0)
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 1.0)


def choose_thresholds(probs: np.ndarray, targets: np.ndarray) -> List[float]:
    """Per tag, the F1-best of :data:`THRESHOLDS` on val (the lowest among equals); 0.5 for a tag val never
    shows, which no threshold can be judged on."""
    chosen = []
    for c in range(targets.shape[1]):
        if not (targets[:, c] > 0.5).any():
            chosen.append(0.5)
            continue
        f1 = [f1_scores(probs[:, c:c + 1], targets[:, c:c + 1], [t])[0] for t in THRESHOLDS]
        chosen.append(THRESHOLDS[int(np.argmax(f1))])
    return chosen


def _plain(items: Sequence[Any]) -> List[Tuple[str, int]]:
    """The samples as (path, 0) pairs: the loaders' form when the targets are kept apart."""
    return [(p, 0) for p, _ in items]


@register_task
class MultiLabel(Task):
    name = "multilabel"
    reads = "images with tags (tags.csv or COCO image-level tags)"
    metric = "macro_map"
    metric_label = "macro mAP"
    budget_unit = "images per tag"
    generator = ("vfm_toolchain.data.synthetic_multilabel", "generate_multilabel_task", "MULTILABEL_GENERATOR_VERSION")

    # ---- data

    starter = {  # recipes/aquarium_tags.yaml
        "max_side": 224,  # the longest input side init proposes
        "recipe": "aquarium_tags.yaml", "labeled": 81, "transfer": 438,
        "teacher": {"adapter": {"name": "full"}, "epochs": 40, "lr": 1.0e-3, "head_lr": 1.0e-2, "batch_size": 16},
        "student": {"name": "fastvit_t8"},
        "distill": {"labeled_images": True, "views": 4, "epochs": 30, "lr": 2.0e-3, "batch_size": 32,
                    "warmup_epochs": 1},
        "finetune": {"epochs": 30, "lr": 5.0e-4, "batch_size": 16},
        "baseline": {"epochs": 100, "lr": 2.0e-3, "batch_size": 16},
    }

    def recognize(self, folder: Any, asked: bool = False) -> Optional[str]:
        """tags.csv; a COCO file only when asked (unasked, it is a detection set)."""
        from vfm_toolchain.data.tags import TAGS_FILE

        root = Path(folder)
        if not (root / "images").is_dir():
            return None
        if (root / TAGS_FILE).is_file():
            return f"images + {TAGS_FILE}"
        return "COCO JSON: an image's tags are its boxes' classes" if asked and (root / "annotations.json").is_file() \
            else None

    def label_counts(self, samples: Sequence[Any], num_classes: int) -> List[int]:
        from vfm_toolchain.data.tags import tag_counts

        return tag_counts(samples, num_classes)

    def write_split(self, samples: Sequence[Any], classes: Sequence[str], folder: Any) -> None:
        from vfm_toolchain.core.files import place_file
        from vfm_toolchain.data.tags import TAGS_FILE, write_tags_csv

        rows = []
        for path, tags in samples:
            place_file(path, Path(folder) / "images" / Path(path).name)
            rows.append((Path(path).name, [classes[t] for t in tags]))
        write_tags_csv(Path(folder) / TAGS_FILE, rows)

    def read_splits(self, ctx: Any, train_dir: str, val_dir: Optional[str], test_dir: str) -> Splits:
        """Tagged splits with train's tag list; a label budget picks whole images, rarest tag first, until each tag
        is in ``labeled_per_class`` of them (data/detection.py ``select_labeled``); without a val folder the
        images outside the budget validate, or a fraction of train."""
        from vfm_toolchain.data.detection import select_labeled
        from vfm_toolchain.data.tags import scan_tag_split, tag_counts

        d, seed = ctx.recipe.data, ctx.recipe.seed
        train = scan_tag_split(train_dir, "train", None, d.roots)
        classes = train.classes
        test = scan_tag_split(test_dir, "test", classes, d.roots)
        val = scan_tag_split(val_dir, "val", classes, d.roots) if val_dir else None
        notes: List[str] = []
        labeled, rest = train.samples, []
        if d.labeled_per_class:
            records = [{"path": p, "labels": t} for p, t in train.samples]
            chosen, others = select_labeled(records, len(classes), d.labeled_per_class, seed)
            labeled, rest = [[r["path"], r["labels"]] for r in chosen], [[r["path"], r["labels"]] for r in others]
            short = [f"'{c}' {n}" for c, n in zip(classes, tag_counts(train.samples, len(classes)))
                     if n < d.labeled_per_class]
            if short:
                notes.append(f"data.labeled_per_class is {d.labeled_per_class} but train has fewer images tagged "
                             f"{', '.join(short)}; each such tag keeps every image it is on")
        if val is None and rest:
            val_samples = rest
            ctx.log.info("no val folder: the %d tagged images outside the budget are the validation set", len(rest))
        elif val is None:
            if len(labeled) < 2:
                raise ToolchainError(f"train folder '{train_dir}' has {len(labeled)} usable tagged image; without "
                                     f"data.val at least 2 are needed: add images or give data.val")
            order = list(labeled)
            random.Random(seed).shuffle(order)
            k = min(max(1, int(round(len(order) * d.val_fraction))), len(order) - 1)
            val_samples, labeled = sorted(order[:k]), sorted(order[k:])
            ctx.log.info("no val folder: held out %d of the tagged images for validation", k)
        else:
            val_samples = val.samples
        splits = {"train": labeled, "val": val_samples, "test": test.samples}
        absent = [c for c, n in zip(classes, tag_counts(labeled, len(classes))) if n == 0]
        if absent:
            notes.append(f"no labeled train image is tagged {', '.join(repr(c) for c in absent)}: the model "
                         f"cannot learn {'them' if len(absent) > 1 else 'it'}")
        index = {"classes": classes, "layout": train.layout, **splits,
                 "corrupt": {"train": train.skipped, "val": val.skipped if val else {}, "test": test.skipped}}
        extra = {"layout": train.layout,
                 "images_per_tag": {role: dict(zip(classes, tag_counts(s, len(classes))))
                                    for role, s in splits.items()},
                 "untagged_images": {role: sum(not t for _, t in s) for role, s in splits.items()}}
        return Splits(index, extra, notes)

    def named_files(self, data: Any) -> List[str]:
        """The images COCO files name (a csv's are under its split's images/)."""
        from vfm_toolchain.data.tags import parse_tag_split, tag_layout

        return [p for role, split in (("train", data.train), ("val", data.val), ("test", data.test))
                if split and tag_layout(split, role) == "coco"
                for p, _ in parse_tag_split(split, role, None, data.roots).samples]

    def describe_data(self, r: Dict[str, Any], section: Any) -> None:
        section.summary.append(f"tags ({r.get('layout')}): images per tag in the labeled train images: "
                               f"{r.get('images_per_tag', {}).get('train')}; untagged images: "
                               f"{r.get('untagged_images')}")
        section.record["data"].update(images_per_tag=r.get("images_per_tag"), untagged_images=r.get("untagged_images"))

    def class_count(self, recipe: Any) -> int:
        from vfm_toolchain.data.tags import read_tag_classes

        d = recipe.data
        return d.synthetic.classes if d.source == "synthetic" else len(read_tag_classes(d.train, d.roots))

    def check_data(self, recipe: Any) -> None:
        """The layout of every split, train's tags (at least two) and the other splits' tags among them, from the
        files alone."""
        from vfm_toolchain.data.tags import parse_tag_split

        d = recipe.data
        train = parse_tag_split(d.train, "train", None, d.roots)
        if len(train.classes) < 2:
            raise ToolchainError(f"train folder '{d.train}' has {len(train.classes)} tag ({', '.join(train.classes)}); "
                                 f"multi-label classification needs at least 2 (with one tag, use classification "
                                 f"with a folder of images without it)")
        for role, folder in (("val", d.val), ("test", d.test)):
            if folder:
                parse_tag_split(folder, role, train.classes, d.roots)

    # ---- training and scores

    def train_dataset(self, items: Sequence[Any], preprocess: Any, augment: str) -> Any:
        """(image, multi-hot float targets) pairs.  The whole image, flipped and recoloured (strong: RandAugment):
        no crop and no erased rectangle, which could take a tagged object out of the picture and leave its tag."""
        import torch
        from torchvision.transforms import v2 as T

        from vfm_toolchain.data.images import ImageListDataset, eval_transform

        if augment not in ("light", "strong"):
            raise ToolchainError(f"unknown augmentation '{augment}'; use light or strong")
        colour = T.RandAugment(num_ops=2, magnitude=9) if augment == "strong" else T.ColorJitter(0.2, 0.2, 0.2)
        transform = T.Compose([T.RandomHorizontalFlip(), colour, eval_transform(preprocess)])
        n = 1 + max((t for _, tags in items for t in tags), default=0)
        targets = torch.from_numpy(multi_hot(items, n))
        return ImageListDataset([(p, targets[i]) for i, (p, _) in enumerate(items)], transform)

    def fit(self, model: Any, groups: Any, index: Dict[str, Any], preprocess: Any, cfg: Any, state: Any, log: Any,
            seed: int, name: str, extra_loss: Any = None, criterion: Any = None) -> List[Dict[str, float]]:
        """Binary cross-entropy of every tag (targets as wide as the tag list, whatever tags the labeled images
        show)."""
        import torch

        from vfm_toolchain.training import fit_classifier

        n = len(index["classes"])
        bce = torch.nn.BCEWithLogitsLoss()

        def loss(out, y):
            if y.shape[1] < n:  # train_dataset sizes its targets by the highest tag it sees
                y = torch.nn.functional.pad(y, (0, n - y.shape[1]))
            return bce(out, y.to(out.dtype))

        return fit_classifier(model, groups, index["train"], preprocess, cfg, state, log, seed, name,
                              val_items=index["val"], extra_loss=extra_loss, criterion=criterion or loss,
                              task=self.name, num_classes=n)

    def probabilities(self, model: Any, items: Sequence[Any], preprocess: Any) -> np.ndarray:
        """[N, C] sigmoid of ``model``'s logits over a split."""
        import torch

        from vfm_toolchain.training import predict_logits

        logits, _ = predict_logits(model, _plain(items), preprocess)
        return torch.sigmoid(logits).numpy()

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        probs = self.probabilities(model, items, preprocess)
        return macro_ap(probs, multi_hot(items, probs.shape[1]))

    def scores(self, model: Any, index: Dict[str, Any], preprocess: Any,
               splits: Sequence[str] = ("val", "test")) -> Dict[str, Any]:
        """``<split>_macro_map`` first, then with val among ``splits`` the per-tag thresholds chosen on it and each
        split's per-tag F1 at them, with test's macro F1."""
        classes = index["classes"]
        probs = {s: self.probabilities(model, index[s], preprocess) for s in splits}
        targets = {s: multi_hot(index[s], len(classes)) for s in splits}
        out: Dict[str, Any] = {f"{s}_{self.metric}": macro_ap(probs[s], targets[s]) for s in splits}
        if "val" in splits:
            chosen = choose_thresholds(probs["val"], targets["val"])
            out["thresholds"] = dict(zip(classes, chosen))
            for s in splits:
                f1 = f1_scores(probs[s], targets[s], chosen)
                out[f"{s}_f1_per_tag"] = {c: round(float(v), 4) for c, v in zip(classes, f1)}
                out[f"{s}_macro_f1"] = float(f1.mean())
        return out

    def describe(self, metrics: Dict[str, Any], splits: Sequence[str] = ("val", "test")) -> str:
        return ", ".join(f"{s} macro mAP {metrics[f'{s}_macro_map']:.4f}" +
                         (f" (macro F1 {metrics[f'{s}_macro_f1']:.4f})" if f"{s}_macro_f1" in metrics else "")
                         for s in splits)

    def summary(self, metrics: Dict[str, Any], split: str = "test") -> str:
        f1 = metrics.get(f"{split}_macro_f1")
        return f"{split} macro mAP {self.score_text(metrics.get(f'{split}_macro_map'))}" + (
            f", macro F1 {self.score_text(f1)} (thresholds chosen on val)" if f1 is not None else "")

    def predict(self, model: Any, x: Any, preprocess: Any, sizes: Sequence[Any], score_thresh: float) -> Any:
        """Per-tag probabilities [B, C]."""
        import torch

        return torch.sigmoid(model(x).float()).cpu()

    # ---- pseudo-labels: the tags above 0.5, reviewed when any tag's call is close

    pseudo_folder = "multilabel"
    label_studio_control = ("Choices", "Choice")
    label_studio_options = {"choice": "multiple"}
    cvat_kind = "tag"

    def pseudo_predictions(self, outs: Any, sizes: Sequence[Any], threshold: float,
                           classes: Sequence[str]) -> List[Dict[str, Any]]:
        """The tags at 0.5 or more; the confidence is the margin of the least sure call over every tag, |2p - 1| in
        [0, 1] (at the default threshold 0.5 an image is kept when every tag is at 0.75 or more, or 0.25 or less)."""
        found = []
        for p in outs[:len(sizes)]:
            p = np.asarray(p, dtype=np.float64)
            tags = [int(c) for c in np.flatnonzero(p >= 0.5)]
            found.append({"tags": tags, "probabilities": [round(float(v), 4) for v in p],
                          "confidence": float(np.abs(2 * p - 1).min()),
                          "summary": ";".join(classes[c] for c in tags) or "(no tag)"})
        return found

    def pseudo_annotations(self, prediction: Dict[str, Any], w: int, h: int, classes: Sequence[str],
                           threshold: float) -> Tuple[List[Dict[str, Any]], List[str]]:
        from xml.sax.saxutils import quoteattr

        names = [classes[c] for c in prediction["tags"]]
        return ([{"type": "choices", "value": {"choices": names}, "score": float(prediction["confidence"])}],
                [f'    <tag label={quoteattr(c)} source="auto"></tag>' for c in names])

    def keep_pseudo_label(self, writer: Any, path: str, name: str, prediction: Dict[str, Any], w: int,
                          h: int) -> None:
        from vfm_toolchain.core.files import place_file

        place_file(path, writer.out / self.pseudo_folder / "images" / name, writer.copy)
        writer.kept.append((name, [writer.classes[c] for c in prediction["tags"]]))

    def finish_pseudo_labels(self, writer: Any) -> None:
        """The kept images' tags.csv and the tag list: a split folder this task reads."""
        from vfm_toolchain.core.files import atomic_write_bytes
        from vfm_toolchain.data.tags import write_tags_csv

        folder = writer.out / self.pseudo_folder
        (folder / "images").mkdir(parents=True, exist_ok=True)
        write_tags_csv(folder / "tags.csv", writer.kept)
        atomic_write_bytes(folder / "classes.txt", "".join(f"{c}\n" for c in writer.classes).encode())

    # ---- artifacts

    def score_artifact(self, run: Any, items: Sequence[Any], preprocess: Any, num_classes: int,
                       batch_size: int) -> float:
        """Macro mAP of ``run(images) -> logits``."""
        logits = artifact_outputs(run, [p for p, _ in items], preprocess, batch_size).astype(np.float64)
        return macro_ap(1 / (1 + np.exp(-logits)), multi_hot(items, num_classes))

    def test_slice(self, items: Sequence[Any], preprocess: Any, num_classes: int, path: Any) -> None:
        """Images resized as the eval transform resizes them, and their [N, C] 0/1 tags (bench/bundle_runner.py
        scores a 2-d label array by macro mAP)."""
        save_slice(path, slice_images([p for p, _ in items], preprocess),
                   multi_hot(items, num_classes).astype(np.uint8), preprocess, num_classes)

def add_tag_report(section: Any, model: str, title: str, result: Dict[str, Any]) -> None:
    """What a multi-label stage adds to the report besides its macro mAP row: its own section with macro mAP and
    macro F1 on val and test, and per tag its threshold chosen on val and its test F1; ``<model>_macro_f1`` among
    build.json's metrics and the per-tag F1 under build.json's ``per_tag_f1.<model>``."""
    m = result.get("metrics", {})
    pct = lambda v: "n/a" if v is None or v != v else f"{100 * v:.1f}%"  # noqa: E731
    section.title = title
    section.lines += ["| split | macro mAP | macro F1 (val thresholds) |", "|---|---|---|",
                      *(f"| {s} | {pct(m.get(f'{s}_macro_map'))} | {pct(m.get(f'{s}_macro_f1'))} |"
                        for s in ("val", "test"))]
    thresholds, f1 = m.get("thresholds") or {}, m.get("test_f1_per_tag") or {}
    if thresholds:
        section.lines += ["", "| tag | threshold (chosen on val) | test F1 |", "|---|---|---|",
                          *(f"| {tag} | {t:g} | {pct(f1.get(tag))} |" for tag, t in thresholds.items())]
    section.record.setdefault("metrics", {})[f"{model}_macro_f1"] = m.get("test_macro_f1")
    section.record.setdefault("per_tag_f1", {})[model] = f1
