"""Layer tables: what the runtime that runs an artifact says about each of its layers (where it ran, in which
precision, how long it took, how many multiply-accumulates it does), assembled the same way for every runtime
file's ``layers`` (the contract is in base.py).  Copied into device bundles with the rest of this folder, so it
imports nothing but the standard library and NumPy.

MACs are counted from shapes the runtime reports, one multiply-accumulate per weight use: a convolution does
``prod(output) * prod(weight[1:])`` (its weight ``[Cout, Cin / groups, kh, kw...]``), a matrix product
``prod(output) * K``.  Element-wise ops, pooling and normalisation count ``None``: they are not what "the share of
the MACs that ran in int8 / on the delegate" is about.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["WARMUP", "RUNS", "conv_macs", "transposed_conv_macs", "matmul_macs", "precision_of", "layer_row",
           "layer_table", "timed_calls", "nms_row"]

WARMUP, RUNS = 5, 50  # calls before the profiled ones (kernels compiled, caches warm), and profiled calls

# element types as runtimes spell them -> the precision a row reports
_PRECISION = {"float": "fp32", "float32": "fp32", "f32": "fp32", "fp32": "fp32",
              "float16": "fp16", "half": "fp16", "f16": "fp16", "fp16": "fp16",
              "bfloat16": "bf16", "bf16": "bf16",
              "int8": "int8", "uint8": "int8", "i8": "int8", "u8": "int8", "char": "int8", "byte": "int8",
              "qs8": "int8", "qu8": "int8", "qc8": "int8", "qd8": "int8", "x8": "int8", "x16": "fp16", "x32": "fp32",
              "int16": "int16", "i16": "int16"}


def _known(shape) -> Optional[List[int]]:
    if shape is None:
        return None
    dims = [int(d) for d in shape]
    return dims if all(d >= 0 for d in dims) else None


def conv_macs(out_shape, weight_shape, grouped: bool = False) -> Optional[int]:
    """Multiply-accumulates of a convolution from its output and weight shapes (``None`` when either is unknown);
    ``grouped``: the weight carries the groups as a leading axis ``[G, Cout / G, Cin / G, kh, kw]`` (OpenVINO)."""
    out, w = _known(out_shape), _known(weight_shape)
    if not out or not w or len(w) < 2:
        return None
    return int(np.prod(out, dtype=np.int64) * np.prod(w[2:] if grouped else w[1:], dtype=np.int64))


def transposed_conv_macs(in_shape, weight_shape) -> Optional[int]:
    """A transposed convolution: every input element meets ``Cout / groups * kh * kw`` weights
    (``weight [Cin, Cout / groups, kh, kw]``)."""
    x, w = _known(in_shape), _known(weight_shape)
    if not x or not w or len(w) < 2:
        return None
    return int(np.prod(x, dtype=np.int64) * np.prod(w[1:], dtype=np.int64))


def matmul_macs(a_shape, out_shape) -> Optional[int]:
    """``prod(output) * K`` of a matrix product (MatMul, Gemm, a fully connected layer, batched or not), with K read
    from the left operand ``a``: its last axis, or the one before when ``a`` is transposed (its last-but-one axis
    then differs from the output's rows; when the two are equal both readings give the same K)."""
    a, out = _known(a_shape), _known(out_shape)
    if not a or not out:
        return None
    k = a[-1] if len(a) < 2 or len(out) < 2 or a[-2] == out[-2] else a[-2]
    return int(np.prod(out, dtype=np.int64) * k)


def precision_of(types: Sequence) -> str:
    """One precision for an op from the element types of its operands (names as the runtime spells them): fp32,
    fp16, bf16 or int8 when they agree on one of those, ``mixed`` when they differ, the type's own name for an op
    on other data (shape arithmetic in int64), ``unknown`` when there is none."""
    names = {_PRECISION.get(str(t).lower(), str(t).lower()) for t in types if t is not None}
    if not names:
        return "unknown"
    if len(names) > 1:
        names -= {"int32", "int64"}  # a bias or an index beside the data does not make an op mixed
    return names.pop() if len(names) == 1 else "mixed"


def layer_row(name: str, type: str, where: str, delegated: Optional[bool], precision: str,
              ms: Optional[float] = None, macs: Optional[int] = None, kernel: Optional[str] = None,
              note: Optional[str] = None) -> Dict:
    """One row of a layer table (base.py names the fields)."""
    return {"name": str(name), "type": str(type), "where": str(where), "delegated": delegated,
            "precision": precision, "kernel": kernel, "ms": None if ms is None else float(ms),
            "macs": None if macs is None else int(macs), "note": note}


def layer_table(runtime: str, provider: str, threads, backend: str, rows: List[Dict], batch: int,
                call_ms: Sequence[float], why_untimed: Optional[str] = None) -> Dict:
    """The table ``layers`` returns: the rows, and the whole-call latency measured over the same profiled calls."""
    timed = why_untimed is None
    total = float(np.mean(call_ms)) if len(call_ms) else None
    return {"runtime": runtime, "provider": provider, "threads": int(threads) if threads else None,
            "backend": backend, "batch": int(batch), "runs": len(call_ms), "total_ms": total, "timed": timed,
            "why_untimed": why_untimed,
            "layer_ms_sum": float(sum(r["ms"] or 0.0 for r in rows)) if timed else None, "rows": rows}


def timed_calls(call: Callable[[], object], warmup: int, runs: int, after: Callable[[], None] = None) -> List[float]:
    """Milliseconds of each of ``runs`` calls after ``warmup`` untimed ones; ``after`` runs after each timed call,
    outside its time (collecting a runtime's per-call counters)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after()
    return times


def nms_row(run, runs: int) -> Optional[Dict]:
    """The row of the NMS a batch-1 detector's runner finishes its candidates with (nms.py), timed over its last
    ``runs`` calls; ``None`` for a runner without one."""
    log = getattr(run, "nms_log", None)
    if log is None:
        return None
    ms = float(np.mean(log[-runs:])) * 1e3 if log else None
    return layer_row("nms (nms.py)", "NMS", "numpy", False, "fp32", ms,
                     note="the NMS the artifact leaves to the app, in NumPy outside the runtime")
