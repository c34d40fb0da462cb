"""Latency and memory measurement: warm-up, timed iterations, percentiles; one JSON row per (artifact,
runtime, batch).  Copied into device bundles, so it needs nothing beyond NumPy and the standard library
(psutil is used when present)."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

import numpy as np

__all__ = ["measure_latency", "PeakMemory", "resident_bytes"]


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


def _proc_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> Optional[int]:
    """This process's resident memory now (Linux /proc, else psutil), or None when neither is there."""
    rss = _proc_status("VmRSS")
    if rss is not None:
        return rss
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return None


class PeakMemory:
    """The resident-memory high-water mark over a block, as growth over a baseline taken at ``start()``.

    Linux resets the kernel's own mark (``VmHWM``, via ``/proc/self/clear_refs``), which sees every
    allocation however short; elsewhere a thread samples the resident size every millisecond (psutil).
    ``peak_bytes()`` is None where neither works, so rows say "not measured" rather than a guess."""

    def __init__(self):
        self.base: Optional[int] = None
        self._linux = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")
        self._stop = threading.Event()
        self._peak = 0
        self._thread: Optional[threading.Thread] = None

    def start(self, base: Optional[int] = None) -> "PeakMemory":
        """Reset the mark; growth is counted over ``base`` (default: the resident size now)."""
        self.base = resident_bytes() if base is None else base
        if self.base is None:
            return self
        if self._linux:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")  # reset the peak to the current resident size
                return self
            except OSError:
                self._linux = False
        self._peak = resident_bytes() or 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, resident_bytes() or 0)

    def peak_bytes(self) -> Optional[int]:
        if self.base is None:
            return None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        elif self._linux:
            self._peak = _proc_status("VmHWM") or 0
        return max(0, self._peak - self.base)
