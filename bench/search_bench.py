"""Pool search benchmark (issue 4): exact faiss vs a plain NumPy matmul + top-k, and an approximate index's
speed-up at a recall target, side by side in one run on clustered synthetic embeddings.

    python -m bench.search_bench --pool 1000000 --dim 768 --queries 5000 --k 100
"""
from __future__ import annotations

import argparse
import time

import faiss
import numpy as np


def clustered(n: int, d: int, centres: int, seed: int, intrinsic: int = 32) -> np.ndarray:
    """Unit vectors around cluster centres, varying mostly along a low-dimensional subspace, the shape
    real image embeddings have (isotropic noise in 768-D would make every neighbour equally near)."""
    rng = np.random.default_rng(0)  # centres and subspace are shared by the pool and the queries
    c = rng.standard_normal((centres, d), dtype=np.float32)
    basis = rng.standard_normal((intrinsic, d), dtype=np.float32) / np.sqrt(intrinsic)
    rng = np.random.default_rng(seed)
    out = np.empty((n, d), dtype=np.float32)
    for s in range(0, n, 100_000):  # in chunks: keeps peak memory near the output array
        m = min(n, s + 100_000) - s
        out[s:s + m] = (c[rng.integers(0, centres, m)]
                        + 0.5 * rng.standard_normal((m, intrinsic), dtype=np.float32) @ basis
                        + 0.05 * rng.standard_normal((m, d), dtype=np.float32))
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--centres", type=int, default=2000)
    ap.add_argument("--index", default="IVF1024,Flat")
    ap.add_argument("--recall", type=float, default=0.95)
    args = ap.parse_args()
    t = time.perf_counter()
    pool = clustered(args.pool, args.dim, args.centres, 0)
    queries = clustered(args.queries, args.dim, args.centres, 1)
    print(f"data: {args.pool} x {args.dim} pool, {args.queries} queries, k={args.k} ({time.perf_counter() - t:.0f} s)")

    flat = faiss.IndexFlatL2(args.dim)
    flat.add(pool)
    t = time.perf_counter()
    _, truth = flat.search(queries, args.k)
    t_flat = time.perf_counter() - t
    t = time.perf_counter()
    mm = numpy_topk(pool, queries, args.k)
    t_np = time.perf_counter() - t
    agree = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(truth[:200].tolist(), mm[:200].tolist())])
    print(f"exact faiss: {t_flat:.1f} s | numpy matmul+top-k: {t_np:.1f} s | ratio {t_np / t_flat:.2f}x "
          f"(agreement {agree:.4f})")

    t = time.perf_counter()
    ivf = faiss.index_factory(args.dim, args.index)
    ivf.train(pool[np.random.default_rng(0).choice(args.pool, min(args.pool, 100_000), replace=False)])
    ivf.add(pool)
    print(f"{args.index}: built in {time.perf_counter() - t:.0f} s")
    for nprobe in (1, 2, 4, 8, 16, 32, 64, 128):
        faiss.ParameterSpace().set_index_parameter(ivf, "nprobe", nprobe)
        t = time.perf_counter()
        _, got = ivf.search(queries, args.k)
        t_ivf = time.perf_counter() - t
        recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(truth.tolist(), got.tolist())])
        print(f"  nprobe {nprobe:4d}: {t_ivf:6.2f} s, recall@{args.k} {recall:.4f}, speed-up {t_flat / t_ivf:5.1f}x")
        if recall >= args.recall:
            print(f"approximate index at recall@{args.k} >= {args.recall}: {t_flat / t_ivf:.1f}x faster than exact")
            break


if __name__ == "__main__":
    main()
