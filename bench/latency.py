"""``bench.latency``: PyTorch eager before and after folding, and every exported artifact its runtime can run.

The unfolded and folded PyTorch models and the ONNX artifact are measured side by side in one run, so
their ratios are meaningful even on a noisy machine.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

import numpy as np
import torch

from bench.measure import measure_latency
from bench.runtimes import RUNTIMES
from export.fold import fold_model
from toolchain.checkpoint import load_model
from toolchain.data import Preprocess
from toolchain.stage import Stage, StageContext, register_stage

__all__ = ["BenchLatency"]

_SOURCE = {"student": "student.finetune", "teacher": "teacher.finetune"}


@register_stage
class BenchLatency(Stage):
    name = "bench.latency"
    inputs = ("export.convert",)
    optional_inputs = ("student.finetune", "teacher.finetune")

    def config(self, recipe) -> Dict[str, Any]:
        return {"bench": recipe.bench.model_dump(mode="json")}

    def skip_reason(self, recipe):
        return None if recipe.bench.runtimes else "bench.runtimes is empty"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        b = ctx.recipe.bench
        for rt in b.runtimes:
            RUNTIMES.check(rt)
        export = ctx.input("export.convert")
        rows: List[Dict[str, Any]] = []
        models = sorted({a["model"] for a in export.result["artifacts"]})
        for which in models:
            folder = ctx.input(_SOURCE[which]).path("model")
            spec = json.loads((folder / "spec.json").read_text())
            pp = Preprocess.from_dict(spec["preprocess"])
            eager = load_model(folder)
            params = sum(p.numel() for p in eager.parameters())
            candidates = []
            if "pytorch" in b.runtimes:
                folded, _ = fold_model(eager, spec, torch.zeros(1, 3, pp.size, pp.size))
                candidates += [(f"{which} eager (unfolded)", "pytorch", eager, None),
                               (f"{which} eager (folded)", "pytorch", folded, None)]
            for art in export.result["artifacts"]:
                if art["model"] != which or art.get("status") != "ok":
                    continue
                for rt in b.runtimes:
                    kinds = RUNTIMES.meta(rt)["artifact"]
                    if art["kind"] in (kinds if isinstance(kinds, list) else [kinds]):
                        candidates.append((f"{which} {art['kind']}", rt, export.dir / art["path"], art))
            for label, rt, obj, art in candidates:
                run = RUNTIMES.get(rt)(obj, b.threads)
                for bs in b.batch_sizes:
                    x = np.random.default_rng(0).standard_normal((bs, 3, pp.size, pp.size)).astype(np.float32)
                    stats = measure_latency(run, x, b.warmup, b.iters)
                    row = {"artifact": label, "model": which, "runtime": rt, "batch": bs, "image_size": pp.size,
                           "params": params, "bytes": art["bytes"] if art else None,
                           "provider": getattr(run, "provider", None), **stats}
                    rows.append(row)
                    ctx.log.info("%-28s %-12s batch %3d  p50 %.2f ms  p90 %.2f ms", label, rt, bs, row["p50_ms"],
                                 row["p90_ms"])
        return {"bench": rows, "threads": b.threads or torch.get_num_threads()}
