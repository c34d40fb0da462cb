"""``bench.latency``: PyTorch eager before and after folding, and every exported artifact its runtime can run.

The unfolded and folded PyTorch models and the ONNX artifact are measured side by side in one run, so
their ratios are meaningful even on a noisy machine.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from bench.measure import measure_stable
from bench.memory_probe import probe_memory
from bench.runtimes import RUNTIMES, Unavailable
from export.fold import fold_model
from export.formats import FORMATS
from toolchain.checkpoint import load_model
from toolchain.console import Track
from toolchain.data import ImageSize, Preprocess, image_hw
from toolchain.errors import ToolchainError
from toolchain.stage import Stage, StageContext, register_stage

__all__ = ["BenchLatency", "count_macs"]

_SOURCE = {"student": "student.finetune", "teacher": "teacher.finetune"}


@register_stage
class BenchLatency(Stage):
    name = "bench.latency"
    version = "4"  # rows measured until stable (or marked unstable); providers fall through TensorRT > CUDA > CPU
    inputs = ("export.convert",)
    optional_inputs = ("student.finetune", "teacher.finetune")

    def config(self, recipe) -> Dict[str, Any]:
        return {"bench": recipe.bench.model_dump(mode="json")}

    def skip_reason(self, recipe):
        return None if recipe.bench.runtimes else "bench.runtimes is empty"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        b = ctx.recipe.bench
        export = ctx.input("export.convert")
        runtimes = timed_runtimes(b.runtimes, export.result["artifacts"])
        rows: List[Dict[str, Any]] = []
        unavailable: List[Dict[str, Any]] = []
        models = sorted({a["model"] for a in export.result["artifacts"]})
        for which in models:
            folder = ctx.input(_SOURCE[which]).path("model")
            spec = json.loads((folder / "spec.json").read_text())
            pp = Preprocess.from_dict(spec["preprocess"])
            eager = load_model(folder)
            params = sum(p.numel() for p in eager.parameters())
            try:
                folded, _ = fold_model(eager, spec, torch.zeros(1, 3, *pp.hw))
            except ToolchainError:  # an adapter that does not fold: export said so; there is no folded model
                folded = None
            macs = count_macs(folded or eager, pp.hw)
            candidates = []
            if "pytorch" in runtimes:
                candidates.append((f"{which} eager (unfolded)", "pytorch", eager, None))
                if folded is not None:
                    candidates.append((f"{which} eager (folded)", "pytorch", folded, None))
            for art in export.result["artifacts"]:
                if art["model"] != which or art.get("status") != "ok":
                    continue
                family = FORMATS.meta(art["kind"])["runtime"] if art["kind"] in FORMATS else None
                for rt in runtimes:
                    if family is not None and RUNTIMES.meta(rt)["runs"] == family:
                        candidates.append((f"{which} {art['kind']}", rt, export.dir / art["path"], art))
            bar = Track(f"timing {which}: {len(candidates)} artifacts x {len(b.batch_sizes)} batch sizes",
                        len(candidates) * len(b.batch_sizes), unit="row", log=ctx.log)
            with bar:
                for label, rt, obj, art in candidates:
                    try:
                        run = RUNTIMES.get(rt)(obj, b.threads, **_runtime_options(rt, art))
                    except Unavailable as why:
                        unavailable.append({"artifact": label, "runtime": rt, "reason": str(why)})
                        ctx.log.info("%-28s %-12s unavailable: %s", label, rt, why)
                        continue
                    peaks = {}
                    if b.memory:  # in a fresh process per candidate: see bench/memory_probe.py
                        source = folder if art is None else obj
                        peaks = probe_memory(rt, source, pp.hw, b.batch_sizes, b.threads, fold=obj is folded)
                    for bs in b.batch_sizes:
                        x = np.random.default_rng(0).standard_normal((bs, 3, *pp.hw)).astype(np.float32)
                        stats = measure_stable(run, x, b.warmup, b.iters, b.repeats, b.max_cv, b.max_tail)
                        row = {"artifact": label, "model": which, "runtime": rt, "batch": bs, "image_size": pp.size,
                               "params": params, "macs": macs, "bytes": art["bytes"] if art else None,
                               "peak_memory_bytes": peaks.get(bs), "provider": getattr(run, "provider", None),
                               "fell_back": getattr(run, "fell_back", None) or None,
                               **stats}
                        rows.append(row)
                        bar.advance()
                        ctx.log.info("%-28s %-12s batch %3d  p50 %.2f ms  p90 %.2f ms%s", label, rt, bs, row["p50_ms"],
                                     row["p90_ms"], f"  UNSTABLE ({row['unstable']})" if row.get("unstable") else "")
                    del run
        return {"bench": rows, "unavailable": unavailable, "threads": b.threads or torch.get_num_threads(),
                "memory": "peak resident memory the runtime added, measured in a fresh process per artifact "
                          "(weights, workspace, activations at that batch)" if b.memory else "not measured"}


def _runtime_options(runtime: str, artifact: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What a runtime takes from the artifact's export record (Core ML: the compute units it targets)."""
    if runtime == "coreml" and artifact is not None:
        return {"compute_units": artifact.get("compute_units", "ALL")}
    return {}


def timed_runtimes(requested: List[str], artifacts: List[Dict[str, Any]]) -> List[str]:
    """``bench.runtimes`` with ``auto`` expanded: pytorch, then for each exported artifact's family the runtime of
    the same name (the family's default: ``onnxruntime`` takes the best provider present)."""
    out: List[str] = []
    for rt in requested:
        if rt != "auto":
            RUNTIMES.check(rt)
            names = [rt]
        else:
            families = [FORMATS.meta(a["kind"])["runtime"] for a in artifacts
                        if a.get("status") == "ok" and a["kind"] in FORMATS]
            names = ["pytorch"] + [f for f in families if f in RUNTIMES]
        for n in names:
            if n not in out:
                out.append(n)
    return out


@torch.no_grad()
def count_macs(model: torch.nn.Module, size: ImageSize) -> Optional[int]:
    """Multiply-accumulates of one image of ``size``, a side or (h, w) (PyTorch's FLOP counter over matmuls,
    convolutions and attention, halved); None when the model cannot be traced by it."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    try:
        with counter:
            model.eval()(torch.zeros(1, 3, *image_hw(size)))
    except Exception:  # an op the counter cannot dispatch: report MACs as unknown, never fail the bench
        return None
    return int(counter.get_total_flops()) // 2
