"""Cached against online teaching (issue 5): the same distillation with the teacher's outputs cached once
per (image, seeded view) and with the teacher run on every step, side by side in one run.

The teacher is much larger than the student (ViT-B/16 at 224 px, 86M parameters, random weights: speed
does not depend on them) and the student is FastViT-T8 at 64 px, on a generated task.

    python -m benchmarks.teacher_cache_bench --pool 256 --epochs 6 --views 2
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from vfm_toolchain.data.synthetic import generate_task
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default="timm:vit_base_patch16_224")
    ap.add_argument("--teacher-size", type=int, default=224)
    ap.add_argument("--student", default="fastvit_t8")
    ap.add_argument("--student-size", type=int, default=64)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = args.work or Path(tempfile.mkdtemp(prefix="cache_bench_"))
    task = generate_task(work / "task", classes=3, labeled_per_class=4, val_per_class=2, test_per_class=2,
                         pool_size=args.pool, distractor_size=0, image_size=64, seed=0)
    rows = {}
    for mode in ("cached", "online"):
        raw = {"name": f"cache_bench_{mode}", "seed": 0,  # threads: the runtime default (OMP_NUM_THREADS)
               "data": {"source": "folders", "train": task["train"], "val": task["val"], "test": task["test"],
                        "pools": task["pools"][:1]},  # the task pool (no distractors generated)
               "teacher": {"name": args.teacher, "weights": "none", "image_size": args.teacher_size,
                           "adapter": {"name": "linear"}, "epochs": 1, "batch_size": 8},
               "curate": {"strategy": "random", "budget": args.pool, "dedup_distance": None,
                          "leakage_distance": None},
               "student": {"name": args.student, "image_size": args.student_size},
               "distill": {"epochs": args.epochs, "views": args.views, "batch_size": 32, "teacher_outputs": mode}}
        build(recipe_from_dict(raw), work / f"out_{mode}", work / "store", only=["student.distill"])
        res = json.loads((work / f"out_{mode}" / "stages" / "student.distill" / "result.json").read_text())
        rows[mode] = res
    print(f"teacher {args.teacher} @ {args.teacher_size} px, student {args.student} @ {args.student_size} px, "
          f"{args.pool} transfer images, {args.epochs} epochs\n")
    print("| teacher outputs | teacher forward (s) | student training (s) | total (s) |")
    print("|---|---|---|---|")
    for mode, r in rows.items():
        total = r["teacher_seconds"] + r["train_seconds"]
        label = f"cached, {args.views} views" if mode == "cached" else "online"
        print(f"| {label} | {r['teacher_seconds']:.1f} | {r['train_seconds']:.1f} | {total:.1f} |")
    c, o = (rows[m]["teacher_seconds"] + rows[m]["train_seconds"] for m in ("cached", "online"))
    print(f"\ncaching speed-up: {o / c:.2f}x (online total / cached total)")


if __name__ == "__main__":
    main()
