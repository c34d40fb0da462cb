"""What checking a cache hit costs (issue 36): the store hashes every file up to 64 MiB whole on each hit and
a larger one by 64 sampled blocks while its size and mtime are as sealed; ``toolchain store --verify`` hashes
everything whole.  Both measured side by side, in one run, on a sealed entry holding one large file, and
optionally on every entry of a real store.

    python -m benchmarks.store_bench --size-mb 1024
    python -m benchmarks.store_bench --size-mb 64 --store ~/.cache/vfm-toolchain
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from vfm_toolchain.store import ArtifactStore


def _timed(fn, rounds: int) -> float:
    """The best of ``rounds`` (the page cache is warm after the first: this is the hash's cost, not the disk's)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        problems = fn()
        best = min(best, time.perf_counter() - t0)
        if problems:
            raise SystemExit(f"verification failed: {problems}")
    return best


def one_large_file(size_mb: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = ArtifactStore(Path(tmp) / "store")
        key = "ab" * 32
        work = s.begin("teacher.curate", key)
        (work / "result.json").write_text("{}")
        with open(work / "embeddings.npy", "wb") as fh:
            for _ in range(size_mb):
                fh.write(os.urandom(1 << 20))
        s.commit("teacher.curate", key, {"stage": "teacher.curate", "key": key})
        hit = _timed(lambda: s.verify("teacher.curate", key), rounds)
        full = _timed(lambda: s.verify("teacher.curate", key, full=True), rounds)
    print(f"one {size_mb} MB file: cache-hit check {hit * 1e3:.1f} ms, whole hash {full * 1e3:.1f} ms "
          f"({full / hit:.0f}x)")


def whole_store(root: Path, rounds: int) -> None:
    s = ArtifactStore(root, create=False)
    sealed = [e for e in s.entries() if e.state == "sealed"]
    total = sum(e.bytes for e in sealed)
    hit = _timed(lambda: [p for e in sealed for p in s.verify(e.stage, e.key, full=False)], rounds)
    full = _timed(lambda: [p for e in sealed for p in s.verify(e.stage, e.key, full=True)], rounds)
    print(f"store {root}: {len(sealed)} sealed entries, {total / 1e6:.0f} MB: cache-hit checks {hit:.2f} s, "
          f"whole hashes {full:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="the large file's size")
    ap.add_argument("--store", type=Path, default=None, help="also time every sealed entry of this store")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    one_large_file(a.size_mb, a.rounds)
    if a.store is not None:
        whole_store(a.store.expanduser(), a.rounds)


if __name__ == "__main__":
    main()
