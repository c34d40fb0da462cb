"""Which pool images to label next, for segmentation (issue 40): label-next's choice against random, on a quick proxy.

The segmentation counterpart of ``selection_bench.py``, on Stanford Background (40 labeled images -> 60, the
issue's target).  The proxy: a linear probe per location (softmax regression on a stride-16 grid) over the frozen
multi-scale features of the real ImageNet MobileNetV2, the stanford_background recipe's teacher before it is
finetuned: the stride-8 map pooled, the stride-16 map and the stride-32 map upsampled, concatenated.  It is trained
on the labeled images of ``stanford_background/train``, then on those plus ``--add`` pool images chosen by each
strategy, whose masks come from the withheld ``unlabeled_masks`` (read only to reveal the chosen images' labels, as
``toolchain study``'s oracle does).  Test mIoU at each mask's own resolution (the probe's grid upsampled).

The labeled images are fixed, so label-next's choice would be one draw; each seed instead offers every strategy the
same random ``--available`` share of the pool, and the table compares them with random paired, seed by seed.
Strategies (every one but random and ``uncertainty_top`` goes through label-next's ``choose``: value-weighted
k-center greedy over the pool embeddings, near-duplicates skipped, balanced over classes):

* ``random``; ``uncertainty_top``: the images of largest mean pixel uncertainty (1 - margin);
* ``uncertainty+typicality``: label-next's choice, value = 0.5 uncertainty + 0.5 typicality (no student here, so
  no disagreement), balanced over every class the probe sees on at least 2% of an image's pixels;
* ``...,largest_class``: the same, balanced over each image's largest class only (label-next before e67f8a5);
* ``...,true_classes``: balanced over the classes the withheld masks show: what a teacher that saw every class
  would choose, the most the class balance can give on this proxy.

    python -m benchmarks.selection_seg_bench --data ../shared/data --seeds 0 1 2 3 4 5 6 7 8 9
    python -m benchmarks.selection_seg_bench --limit 40 --seeds 0 --image-size 64 96 --steps 20   # a quick run
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.curation_bench import WEIGHTS
from vfm_toolchain.blocks.detection import torchvision_feature_plan
from vfm_toolchain.data.segmentation import IGNORE_INDEX, SegmentationDataset, list_segmentation_pairs
from vfm_toolchain.segmetrics import confusion_matrix, mean_iou
from vfm_toolchain.students.label_next import choose, segmentation_parts, typicality
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.vectors import PoolVectors

BALANCE = {"uncertainty+typicality": "seen", "uncertainty+typicality,largest_class": "largest",
           "uncertainty+typicality,true_classes": "true"}
STRATEGIES = ["random", "uncertainty_top", *BALANCE]
GRID = 16  # the probe's stride


class Features:
    """Per image: the probe's input [D, h/16, w/16], the pooled embedding (unit length), the mask at its own size."""

    def __init__(self, image_size, batch_size: int):
        self.backbone = create_backbone("torchvision:mobilenet_v2", WEIGHTS, image_size).eval()
        self.reader, _ = torchvision_feature_plan(self.backbone.model)
        self.pp, self.batch_size = self.backbone.preprocess, batch_size

    @torch.no_grad()
    def __call__(self, items, what: str):
        ds = SegmentationDataset([(str(i), str(m)) for i, m in items], self.pp, train=False)
        grids, embs, masks = [], [], []
        for i in range(0, len(ds), self.batch_size):
            xs, ms = zip(*[ds[j] for j in range(i, min(i + self.batch_size, len(ds)))])
            x = torch.stack(xs)
            s8, s16, s32 = self.reader(self.backbone, x)
            grids.append(torch.cat([F.avg_pool2d(s8, 2), s16, F.interpolate(s32, size=s16.shape[-2:], mode="bilinear",
                                                                             align_corners=False)], 1).half())
            # the backbone's pooled embedding is the mean of its stride-32 map (its last layer), read already
            embs.append(F.normalize(s32.mean((2, 3)), dim=1))
            masks.extend(ms)
        print(f"  {what}: {len(ds)} images", flush=True)
        return torch.cat(grids), torch.cat(embs).numpy(), masks


def grid_labels(masks, hw) -> torch.Tensor:
    """Each mask's majority class per cell of the probe's grid ``hw`` (-1 where most of the cell is ignored)."""
    out = []
    for m in masks:
        m = F.interpolate(m[None, None].float(), size=(hw[0] * GRID, hw[1] * GRID), mode="nearest")[0, 0].long()
        valid = m != IGNORE_INDEX
        m = torch.where(valid, m, torch.zeros_like(m))
        votes = F.one_hot(m, 256)[..., :IGNORE_INDEX].permute(2, 0, 1).float() * valid
        votes = F.avg_pool2d(votes[None], GRID)[0]
        y = votes.argmax(0)
        y[votes.sum(0) < 0.5] = -1
        out.append(y)
    return torch.stack(out)


def true_classes(masks, classes: int, min_share: float = 0.02) -> np.ndarray:
    """[N, classes] bool: the classes each mask shows on at least ``min_share`` of its labeled pixels."""
    rows = []
    for m in masks:
        v = m[m != IGNORE_INDEX]
        rows.append((torch.bincount(v, minlength=classes)[:classes] / max(1, len(v))).numpy() >= min_share)
    return np.stack(rows)


class Probe:
    """Softmax regression per grid cell, on features standardised by the first labeled images' statistics."""

    def __init__(self, x: torch.Tensor, classes: int, steps: int, wd: float):
        x = x.float()
        self.mu, self.sd = x.mean((0, 2, 3))[:, None, None], x.std((0, 2, 3))[:, None, None] + 1e-6
        self.classes, self.steps, self.wd = classes, steps, wd

    def z(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() - self.mu) / self.sd).permute(0, 2, 3, 1)

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Linear:
        torch.manual_seed(0)
        z, t = self.z(x).reshape(-1, x.shape[1]), y.reshape(-1)
        z, t = z[t >= 0], t[t >= 0]
        lin = torch.nn.Linear(x.shape[1], self.classes)
        opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=self.wd)
        for _ in range(self.steps):
            opt.zero_grad()
            F.cross_entropy(lin(z), t).backward()
            opt.step()
        return lin

    @torch.no_grad()
    def probs(self, lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return lin(self.z(x)).softmax(-1).permute(0, 3, 1, 2)

    @torch.no_grad()
    def miou(self, lin: torch.nn.Linear, x: torch.Tensor, masks) -> float:
        cm = torch.zeros(self.classes, self.classes, dtype=torch.long)
        for logits, mask in zip(lin(self.z(x)).permute(0, 3, 1, 2), masks):
            up = F.interpolate(logits[None], size=tuple(mask.shape), mode="bilinear", align_corners=False)[0]
            cm += confusion_matrix(up.argmax(0), mask, self.classes)
        return 100 * mean_iou(cm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--add", type=int, default=20, help="pool images each strategy adds to the labeled ones")
    ap.add_argument("--available", type=float, default=0.8, help="the share of the pool each seed offers")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    ap.add_argument("--image-size", type=int, nargs=2, default=[192, 256], metavar=("H", "W"),
                    help="the recipe's; multiples of 32")
    ap.add_argument("--steps", type=int, default=300, help="full-batch Adam steps of each probe fit")
    ap.add_argument("--wd", type=float, default=1e-3, help="the probe's weight decay")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="the first N pool and test images (a quick run)")
    args = ap.parse_args()
    if not 0 < args.available <= 1:
        raise SystemExit(f"--available is the share of the pool each seed offers, in (0, 1]; got {args.available}")

    sb = args.data / "stanford_background"
    classes = [c for c in (sb / "train" / "classes.txt").read_text().splitlines() if c.strip()]
    labeled, _ = list_segmentation_pairs(sb / "train", "train")
    test, _ = list_segmentation_pairs(sb / "test", "test")
    pool = [(img, sb / "unlabeled_masks" / f"{img.stem}.png")
            for img in sorted((sb / "unlabeled" / "images").iterdir()) if (sb / "unlabeled_masks" / f"{img.stem}.png").is_file()]
    test, pool = test[:args.limit], pool[:args.limit]
    if len(pool) * args.available < args.add:
        raise SystemExit(f"{len(pool)} pool images x --available {args.available} offer fewer than --add {args.add}")

    t0 = time.time()
    features = Features(tuple(args.image_size), args.batch_size)
    lab_x, lab_e, lab_m = features(labeled, "labeled")
    pool_x, pool_e, pool_m = features(pool, "pool (its withheld masks)")
    test_x, _, test_m = features(test, "test")
    print(f"features of {len(labeled)} labeled + {len(pool)} pool + {len(test)} test images in {time.time() - t0:.1f} s")
    hw = tuple(lab_x.shape[-2:])
    lab_y, pool_y = grid_labels(lab_m, hw), grid_labels(pool_m, hw)
    k = len(classes)

    probe = Probe(lab_x, k, args.steps, args.wd)
    first = probe.fit(lab_x, lab_y)
    start = probe.miou(first, test_x, test_m)
    p_pool = probe.probs(first, pool_x)
    uncertainty, _, largest = segmentation_parts(p_pool, p_pool)
    seen = {"seen": student_task("segmentation").classes_seen(p_pool, k, 0.3, 0.02), "true": true_classes(pool_m, k)}
    have = {"seen": student_task("segmentation").classes_seen(probe.probs(first, lab_x), k, 0.3, 0.02).sum(0),
            "true": true_classes(lab_m, k).sum(0)}
    vectors = PoolVectors.from_array(np.ascontiguousarray(pool_e, dtype=np.float32))
    value = 0.5 * uncertainty + 0.5 * typicality(vectors)
    print(f"the first {len(labeled)} labeled images show (their masks): "
          + ", ".join(f"{c} {n}" for c, n in zip(classes, have["true"])))

    rows = {name: [] for name in args.strategies}
    shown = {name: [] for name in args.strategies}
    for seed in args.seeds:
        r = np.random.default_rng(seed)
        offered = np.zeros(len(pool), dtype=bool)
        offered[r.permutation(len(pool))[:int(round(args.available * len(pool)))]] = True
        for name in args.strategies:
            if name == "random":
                chosen = r.permutation(np.flatnonzero(offered))[:args.add]
            elif name == "uncertainty_top":
                chosen = np.argsort(-np.where(offered, uncertainty, -np.inf), kind="stable")[:args.add]
            else:
                balance = BALANCE[name]
                v = np.where(offered, value, -np.inf)
                if balance == "largest":
                    rank = choose(v, largest, vectors, lab_e, args.add)["rank"]
                else:
                    rank = choose(v, largest, vectors, lab_e, args.add, seen=seen[balance], have=have[balance])["rank"]
                chosen = np.flatnonzero(rank)
            x, y = torch.cat([lab_x, pool_x[chosen]]), torch.cat([lab_y, pool_y[chosen]])
            rows[name].append(probe.miou(probe.fit(x, y), test_x, test_m))
            shown[name].append(true_classes([pool_m[i] for i in chosen], k).sum(0))
        print(f"seed {seed}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in rows.items()), flush=True)

    n = len(args.seeds)
    sd = lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    print(f"\n{len(labeled)} -> {len(labeled) + args.add} labeled images, linear probe test mIoU over {n} seed(s) "
          f"({len(test)} test images, {len(pool)} pool images, {args.available:.0%} offered a seed)\n")
    print(f"| labels | test mIoU | against random, paired (standard error) | images showing each class "
          f"({', '.join(classes)}), mean of the {args.add} |")
    print("|---|---|---|---|")
    print(f"| the {len(labeled)} labeled | {start:.2f} | | |")
    for name, v in rows.items():
        gain = (f"{np.mean(np.subtract(v, rows['random'])):+.2f} ({sd(np.subtract(v, rows['random'])) / np.sqrt(n):.2f})"
                if name != "random" and "random" in rows else "")
        counts = " / ".join(f"{c:.1f}" for c in np.mean(shown[name], axis=0))
        print(f"| + {args.add}: {name} | {np.mean(v):.2f} +- {sd(v):.2f} | {gain} | {counts} |")


if __name__ == "__main__":
    main()
