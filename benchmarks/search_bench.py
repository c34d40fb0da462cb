"""Pool search benchmark (issues 4 and 17): the auto-tuned approximate index against exact faiss, side by side
in one run on clustered synthetic embeddings, build time reported apart from search time.

    python -m benchmarks.search_bench --pool 1000000 --dim 768 --queries 5000 --k 100
    python -m benchmarks.search_bench --pool 10000000 --dim 768 --queries 5000 --k 100 --workdir /tmp/search10m

The index is what ``curate.index: auto`` builds (teachers/search.py): chosen from the pool size and the memory
budget, then tuned on a separate sample of queries until recall@k reaches ``--recall``; the evaluation queries
are not used for tuning.  A pool whose float32 vectors exceed half of this machine's memory is written to
``--workdir`` as an fp16 memory map (the shape of a real pool's embedding shards) and never held in memory;
exact search then streams it for a sample of the queries (the recall reference) instead of timing a full
exact pass.  ``--numpy`` adds issue 4's plain NumPy matmul + top-k comparison.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

import faiss
import numpy as np

from vfm_toolchain.teachers.search import PoolIndex, memory_budget
from vfm_toolchain.teachers.vectors import PoolVectors

CHUNK = 100_000


def clustered_chunks(n: int, d: int, centres: int, seed: int, intrinsic: int = 32) -> Iterator[np.ndarray]:
    """Unit vectors around cluster centres, varying mostly along a low-dimensional subspace, the shape real
    image embeddings have (isotropic noise in 768-D would make every neighbour equally near); in chunks, so a
    pool larger than memory can be written out as it is drawn."""
    rng = np.random.default_rng(0)  # centres and subspace are shared by the pool and the queries
    c = rng.standard_normal((centres, d), dtype=np.float32)
    basis = rng.standard_normal((intrinsic, d), dtype=np.float32) / np.sqrt(intrinsic)
    rng = np.random.default_rng(seed)
    for s in range(0, n, CHUNK):
        m = min(n, s + CHUNK) - s
        out = (c[rng.integers(0, centres, m)] + 0.5 * rng.standard_normal((m, intrinsic), dtype=np.float32) @ basis
               + 0.05 * rng.standard_normal((m, d), dtype=np.float32))
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        yield out


def clustered(n: int, d: int, centres: int, seed: int) -> np.ndarray:
    out = np.empty((n, d), dtype=np.float32)
    for i, block in enumerate(clustered_chunks(n, d, centres, seed)):
        out[i * CHUNK:i * CHUNK + len(block)] = block
    return out


def on_disk(n: int, d: int, centres: int, workdir: Path) -> np.ndarray:
    """The pool as an fp16 memory map under ``workdir`` (reused when a previous run left it complete)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path, done = workdir / f"pool_{n}x{d}_c{centres}.f16", workdir / f"pool_{n}x{d}_c{centres}.done"
    if not done.exists():
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, d))
        for i, block in enumerate(clustered_chunks(n, d, centres, 0)):
            mm[i * CHUNK:i * CHUNK + len(block)] = block
        mm.flush()
        del mm
        done.touch()
    return np.load(path, mmap_mode="r")


def numpy_topk(pool: np.ndarray, q: np.ndarray, k: int, chunk: int = 500) -> np.ndarray:
    """Exact k-NN by matmul: ||p||^2 - 2 q.p per chunk of queries, argpartition then sort."""
    sq = (pool ** 2).sum(1)
    out = np.empty((len(q), k), dtype=np.int64)
    for s in range(0, len(q), chunk):
        d = sq[None, :] - 2 * q[s:s + chunk] @ pool.T
        part = np.argpartition(d, k, axis=1)[:, :k]
        order = np.take_along_axis(d, part, 1).argsort(1)
        out[s:s + chunk] = np.take_along_axis(part, order, 1)
    return out


def overlap(truth: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(truth.tolist(), got.tolist())]))


def memory() -> str:
    """Resident memory now, anonymous (what the process holds) apart from file-backed pages of the memory map
    (page cache the kernel reclaims under pressure), and the peak resident set."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    gib = {k: int(fields[k].split()[0]) / (1 << 20) for k in ("RssAnon", "RssFile") if k in fields}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # Linux reports KiB
    return (f"resident {gib.get('RssAnon', float('nan')):.1f} GiB anonymous + {gib.get('RssFile', float('nan')):.1f} "
            f"GiB mapped file pages, peak resident {peak:.1f} GiB")


def exact_reference(pool, queries: np.ndarray, k: int, numpy: bool) -> Tuple[Optional[float], np.ndarray, np.ndarray]:
    """(seconds for a full exact faiss pass or None, the queries with ground truth, their ground truth)."""
    if isinstance(pool, np.ndarray) and pool.dtype == np.float32:
        flat = faiss.IndexFlatL2(pool.shape[1])
        flat.add(pool)
        t = time.perf_counter()
        _, truth = flat.search(queries, k)
        t_flat = time.perf_counter() - t
        del flat
        print(f"exact faiss (IndexFlatL2), {len(queries)} queries: {t_flat:.1f} s")
        if numpy:
            t = time.perf_counter()
            mm = numpy_topk(pool, queries, k)
            t_np = time.perf_counter() - t
            print(f"numpy matmul+top-k: {t_np:.1f} s, {t_np / t_flat:.2f}x exact faiss "
                  f"(agreement {overlap(truth[:200], mm[:200]):.4f})")
        return t_flat, queries, truth
    sample = queries[np.random.default_rng(3).choice(len(queries), 200, replace=False)]
    t = time.perf_counter()
    stream = PoolIndex(PoolVectors([pool]), "flat", memory_rows=0)  # exact, streamed from the memory map
    _, truth = stream.search(sample, k)
    print(f"exact reference: 200 of the queries streamed over the memory-mapped pool in "
          f"{time.perf_counter() - t:.0f} s (a full exact pass is not timed: the pool is not in memory)")
    return None, sample, truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--tune-queries", type=int, default=500, help="a separate query sample the index is tuned on")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--centres", type=int, default=2000)
    ap.add_argument("--recall", type=float, default=0.95)
    ap.add_argument("--index", default="auto", help="auto, or a faiss index-factory string")
    ap.add_argument("--memory-gb", type=float, default=None, help="index memory budget (default: half of RAM)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/search_bench"), help="where a pool too large for "
                                                                                   "memory is written")
    ap.add_argument("--exact-max", type=int, default=200_000, help="curate.exact_max: auto is exact up to this size")
    ap.add_argument("--on-disk", action="store_true", help="write the pool to --workdir even if it fits in memory")
    ap.add_argument("--keep", action="store_true", help="keep the on-disk pool for another run")
    ap.add_argument("--numpy", action="store_true", help="also time NumPy matmul + top-k (issue 4)")
    args = ap.parse_args()

    t = time.perf_counter()
    in_memory = args.pool * args.dim * 4 <= memory_budget(None) and not args.on_disk
    pool = (clustered(args.pool, args.dim, args.centres, 0) if in_memory
            else on_disk(args.pool, args.dim, args.centres, args.workdir))
    queries = clustered(args.queries, args.dim, args.centres, 1)
    tune_q = clustered(args.tune_queries, args.dim, args.centres, 2)
    print(f"data: {args.pool:,} x {args.dim} pool ({'in memory, float32' if in_memory else 'fp16 memory map'}), "
          f"{args.queries} queries + {args.tune_queries} for tuning, k={args.k} ({time.perf_counter() - t:.0f} s)")

    t_flat, ref_q, truth = exact_reference(pool, queries, args.k, args.numpy)

    t = time.perf_counter()
    index = PoolIndex(PoolVectors([pool]), args.index, args.exact_max, memory_gb=args.memory_gb)
    print(f"index {index.spec}: {index.why}; built in {index.build_seconds:.0f} s; {memory()}")
    tuning = index.tune(tune_q, args.k, args.recall, sample=args.tune_queries)
    print(f"tuned on {tuning['sample']} held-out queries in {time.perf_counter() - t - index.build_seconds:.0f} s: "
          f"{tuning['params']} -> recall@{args.k} {tuning['recall']:.4f} (95% lower bound {tuning['recall_low']:.4f})")
    for trial in tuning["trials"]:
        print(f"  {trial}")
    t = time.perf_counter()
    _, got = index.search(queries, args.k)
    t_ann = time.perf_counter() - t
    ref_rows = {r.tobytes(): i for i, r in enumerate(queries)}
    got_ref = got[[ref_rows[r.tobytes()] for r in ref_q]]
    recall = overlap(truth, got_ref)
    print(f"approximate search, {len(queries)} queries: {t_ann:.2f} s, recall@{args.k} {recall:.4f} "
          f"(on {len(ref_q)} queries against exact)")
    if t_flat is not None:
        print(f"approximate index at recall@{args.k} {recall:.3f}: {t_flat / t_ann:.1f}x faster than exact faiss "
              f"(build {index.build_seconds:.0f} s, not included)")
    print(memory())
    if not in_memory and not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
