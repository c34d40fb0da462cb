"""Latency measurement: warm-up, timed iterations, percentiles; one JSON row per (artifact, runtime, batch)."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict

import numpy as np

__all__ = ["measure_latency"]


def measure_latency(run: Callable[[np.ndarray], Any], x: np.ndarray, warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        run(x)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run(x)
        times.append((time.perf_counter() - t0) * 1e3)
    t = np.asarray(times)
    return {"p50_ms": float(np.percentile(t, 50)), "p90_ms": float(np.percentile(t, 90)),
            "p99_ms": float(np.percentile(t, 99)), "mean_ms": float(t.mean()), "std_ms": float(t.std()),
            "throughput_ips": float(x.shape[0] * 1e3 / t.mean()), "iters": iters}
