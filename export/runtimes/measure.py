"""Latency and memory measurement: warm-up, timed iterations, percentiles; one JSON row per (artifact,
runtime, batch).  Copied into device bundles, so it needs nothing beyond NumPy and the standard library
(psutil is used when present)."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

__all__ = ["measure_latency", "measure_stable", "round_robin", "latency_cell", "PeakMemory", "resident_bytes", "MAX_CV", "MAX_TAIL",
           "REPEATS"]

# When is a latency row a number a person can trust?  A timing loop on a quiet machine has a tight spread;
# another process competing for the cores shows up as a wide one (seen here: p50 231 ms beside p99 2,421 ms).
# A row is *stable* when its coefficient of variation (std / mean of the timed iterations) is at most MAX_CV
# and its tail (p99 / p50) at most MAX_TAIL.  An unstable row is measured again, up to REPEATS rounds in all,
# and the steadiest round is kept; if no round is stable the row says "unstable: machine busy" and the
# report shows that instead of a figure.
MAX_CV = 0.3
MAX_TAIL = 2.5
REPEATS = 3


def measure_latency(run: Callable[[np.ndarray], Any], x: np.ndarray, warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        run(x)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run(x)
        times.append((time.perf_counter() - t0) * 1e3)
    t = np.asarray(times)
    p50 = float(np.percentile(t, 50))
    return {"p50_ms": p50, "p90_ms": float(np.percentile(t, 90)),
            "p99_ms": float(np.percentile(t, 99)), "mean_ms": float(t.mean()), "std_ms": float(t.std()),
            "throughput_ips": float(x.shape[0] * 1e3 / t.mean()), "iters": iters,
            "cv": float(t.std() / t.mean()) if t.mean() > 0 else 0.0,
            "tail": float(np.percentile(t, 99) / p50) if p50 > 0 else 1.0}


def round_robin(candidates: Dict[str, Callable[[np.ndarray], Any]], x: np.ndarray, rounds: int, per_round: int,
                warmup: int) -> Dict[str, float]:
    """Median milliseconds per call of each candidate, timed in turn (``per_round`` calls each, ``rounds`` times), so
    drift in a busy machine's speed hits every candidate alike: how the toolchain compares candidates side by side."""
    times: Dict[str, List[float]] = {k: [] for k in candidates}
    for run in candidates.values():
        for _ in range(warmup):
            run(x)
    for _ in range(rounds):
        for name, run in candidates.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def measure_stable(run: Callable[[np.ndarray], Any], x: np.ndarray, warmup: int, iters: int,
                   repeats: int = REPEATS, max_cv: float = MAX_CV, max_tail: float = MAX_TAIL) -> Dict[str, Any]:
    """``measure_latency`` until a round is stable (see MAX_CV / MAX_TAIL), at most ``repeats`` rounds.

    The row is the steadiest round (smallest cv + tail excess) and says how many rounds it took; an
    unstable row carries ``unstable`` with the reason, so a report never shows noise as a figure."""
    best: Optional[Dict[str, Any]] = None
    rounds = 0
    for rounds in range(1, max(1, repeats) + 1):
        stats = measure_latency(run, x, warmup if rounds == 1 else min(warmup, 2), iters)
        score = stats["cv"] / max_cv + stats["tail"] / max_tail
        if best is None or score < best["_score"]:
            best = {**stats, "_score": score}
        if stats["cv"] <= max_cv and stats["tail"] <= max_tail:
            break
    assert best is not None
    best.pop("_score")
    best["rounds"] = rounds
    if best["cv"] > max_cv or best["tail"] > max_tail:
        best["unstable"] = (f"machine busy: cv {best['cv']:.2f} (limit {max_cv}), p99/p50 {best['tail']:.1f} "
                            f"(limit {max_tail}) after {rounds} rounds")
    return best


def latency_cell(row: Dict[str, Any], key: str = "p50_ms") -> str:
    """A latency figure for a table, or ``unstable`` when the row could not be measured steadily."""
    return "unstable: machine busy" if row.get("unstable") else f"{row[key]:.2f}"


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
