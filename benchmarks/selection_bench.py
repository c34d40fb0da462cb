"""Which pool images to label next (issue 40): label-next's score parts against random choice, on a quick proxy.

The proxy: a linear probe (logistic regression) on the frozen features of the real ImageNet MobileNetV2 at 96 px,
the cifar10_fewshot recipe's teacher (its linear adapter), trained on ``--start`` labels per class of
``cifar10/labeled`` and then on those plus ``--add`` per class chosen from ``cifar10/unlabeled`` by each strategy,
labeled from the withheld ``unlabeled_labels.csv`` (read only to reveal the chosen images' labels, as
``toolchain study``'s oracle does).  Test top-1 on ``cifar10/test``.  A whole study (teacher, distillation and
finetune per budget and seed) takes hours here; this takes minutes and shows what the teacher, which the student
follows, gains from each choice.  There is no student, so disagreement is left out; every strategy but random
and ``uncertainty_top`` goes through label-next's choice (``students/label_next.py``: class-balanced,
value-weighted k-center greedy over the pool embeddings, near-duplicates skipped).

    python -m benchmarks.selection_bench --data ../shared/data --seeds 0 1 2 3 4 5 6 7 8 9
    python -m benchmarks.selection_bench --limit 300 --seeds 0 --work /tmp/sb_bench     # a quick run
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

from benchmarks.curation_bench import WEIGHTS, embed
from vfm_toolchain.data.images import scan_image_folder
from vfm_toolchain.data.pools import list_pool_source
from vfm_toolchain.students.label_next import choose, typicality
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.model import TeacherClassifier
from vfm_toolchain.teachers.vectors import PoolVectors

# name -> label-next weights (uncertainty, typicality), or None for a rule of its own
STRATEGIES = {"random": None, "uncertainty_top": None, "uncertainty": (1.0, 0.0), "typicality": (0.0, 1.0),
              "uncertainty+typicality": (0.5, 0.5)}


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


class Probe:
    """Logistic regression on standardised features (the statistics of the first labels, kept for every fit)."""

    def __init__(self, x: np.ndarray, c: float):
        self.mu, self.sd, self.c = x.mean(0), x.std(0) + 1e-6, c

    def fit(self, x: np.ndarray, y: np.ndarray):
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=self.c, max_iter=2000).fit(self.z(x), y)

    def z(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mu) / self.sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--work", type=Path, default=Path("runs/selection_bench"))
    ap.add_argument("--start", type=int, default=25, help="labels per class the probe starts from")
    ap.add_argument("--add", type=int, default=10, help="labels per class each strategy adds (times the classes)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--c", type=float, default=0.05, help="the probe's inverse L2 strength")
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="the first N pool and test images (a quick run)")
    args = ap.parse_args()

    cifar = args.data / "cifar10"
    labeled = scan_image_folder(cifar / "labeled", "labeled")
    test = scan_image_folder(cifar / "test", "test")
    classes = labeled.classes
    if test.classes != classes:
        raise SystemExit(f"cifar10/test has classes {test.classes}, cifar10/labeled {classes}: they must match")
    with open(cifar / "unlabeled_labels.csv") as fh:
        truth = {row["file"]: row["label"] for row in csv.DictReader(fh)}
    pool = [p for p in list_pool_source(str(cifar / "unlabeled")) if truth.get(Path(p).name) in classes]
    rng = np.random.default_rng(0)
    test_samples = test.samples if args.limit is None else [test.samples[i] for i in
                                                             rng.permutation(len(test.samples))[:args.limit]]
    pool = pool[:args.limit]
    pool_y = np.array([classes.index(truth[Path(p).name]) for p in pool])

    encoder = TeacherClassifier(create_backbone("torchvision:mobilenet_v2", WEIGHTS, args.image_size), 1, True)
    t0 = time.time()
    lab_x = embed(encoder, [p for p, _ in labeled.samples], args.work / "labeled", args.batch_size)
    test_x = embed(encoder, [p for p, _ in test_samples], args.work / f"test_{len(test_samples)}", args.batch_size)
    pool_x = embed(encoder, pool, args.work / f"pool_{len(pool)}", args.batch_size)
    print(f"embedded {len(lab_x)} labeled + {len(test_x)} test + {len(pool_x)} pool images in "
          f"{time.time() - t0:.1f} s (cached in {args.work})")
    lab_y = np.array([c for _, c in labeled.samples])
    test_y = np.array([c for _, c in test_samples])
    vectors = PoolVectors.from_array(unit(pool_x))
    typ = typicality(vectors)
    n = args.add * len(classes)

    rows = {name: [] for name in ["start"] + args.strategies}
    for seed in args.seeds:
        r = np.random.default_rng(seed)
        first = np.concatenate([r.permutation(np.flatnonzero(lab_y == c))[:args.start] for c in range(len(classes))])
        probe = Probe(lab_x[first], args.c)
        clf = probe.fit(lab_x[first], lab_y[first])
        rows["start"].append(100 * (clf.predict(probe.z(test_x)) == test_y).mean())
        p = clf.predict_proba(probe.z(pool_x))
        top = np.sort(p, axis=1)[:, ::-1]
        margin = 1 - (top[:, 0] - top[:, 1])  # label-next's default uncertainty
        for name in args.strategies:
            weights = STRATEGIES[name]
            if name == "random":
                chosen = r.permutation(len(pool))[:n]
            elif name == "uncertainty_top":
                chosen = np.argsort(-margin, kind="stable")[:n]
            else:
                value = weights[0] * margin + weights[1] * typ
                rank = choose(value, p.argmax(1), vectors, unit(lab_x[first]), n)["rank"]
                chosen = np.flatnonzero(rank)
            x = np.concatenate([lab_x[first], pool_x[chosen]])
            y = np.concatenate([lab_y[first], pool_y[chosen]])
            rows[name].append(100 * (probe.fit(x, y).predict(probe.z(test_x)) == test_y).mean())
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)

    k = len(args.seeds)
    sd = lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    print(f"\n{args.start} -> {args.start + args.add} labels per class, linear probe test top-1 over {k} seed(s) "
          f"({len(test_y)} test images, {len(pool)} pool images)\n")
    print("| labels | test top-1 | against random, paired (standard error) |")
    print("|---|---|---|")
    for name, v in rows.items():
        gain = (f"{np.mean(np.subtract(v, rows['random'])):+.2f} ({sd(np.subtract(v, rows['random'])) / np.sqrt(k):.2f})"
                if name != "start" and "random" in rows else "")
        label = f"the first {args.start} per class" if name == "start" else f"+ {args.add} per class: {name}"
        print(f"| {label} | {np.mean(v):.2f} +- {sd(v):.2f} | {gain} |")


if __name__ == "__main__":
    main()
