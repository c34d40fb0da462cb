"""Compare teacher adapters on one recipe: test top-1, trainable parameters, training time.

    python -m benchmarks.compare_adapters recipes/cifar10_fewshot.yaml linear lora full llu clip_adapter

Each adapter is a ``teacher.finetune`` build of the same recipe with ``--set teacher.adapter.name=...``
(through the store, so finished ones are reused); prints a Markdown table.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from vfm_toolchain.recipe import load_recipe
from vfm_toolchain.runner import build
from vfm_toolchain.store import default_store_root


def main(argv) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    recipe_path, adapters = argv[0], argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for name in adapters:
        recipe = load_recipe(recipe_path, [f"teacher.adapter={{name: {name}}}"])
        out = Path("runs") / f"{recipe.name}_adapter_{name}"
        record = build(recipe, out, default_store_root(), only=["teacher.finetune"])
        stage = next(s for s in record["stages"] if s["name"] == "teacher.finetune")
        result = json.loads((out / "stages" / "teacher.finetune" / "result.json").read_text())
        meta = json.loads((out / "stages" / "teacher.finetune" / "DONE").read_text())
        rows.append((name, result["metrics"]["test_top1"], result["trainable_params"], result["params"],
                     meta["seconds"], stage["status"]))
    print("| adapter | test top-1 | trainable params | training time (s) |")
    print("|---|---|---|---|")
    for name, top1, trainable, total, seconds, status in rows:
        print(f"| `{name}` | {100 * top1:.1f}% | {trainable:,} of {total:,} | {seconds:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
