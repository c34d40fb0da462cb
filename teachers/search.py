"""k-NN search over an embedded pool with faiss: exact while the pool is small, an approximate index
(any faiss index-factory string: ``IVF1024,PQ32``, ``HNSW32``, ...) beyond, on GPU when faiss-gpu and
CUDA are present.  The recall of an approximate index is measured against exact search on a sample of
queries, so a build knows (and can demand) how much the speed cost.
"""
from __future__ import annotations

from typing import Optional, Tuple

import faiss
import numpy as np

from toolchain.errors import ToolchainError

__all__ = ["PoolIndex"]


def _gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class PoolIndex:
    """Euclidean k-NN over ``vectors`` (N, D).

    Args:
        spec: 'flat' (exact), 'auto' (exact up to ``exact_max`` vectors, else IVF-PQ sized to the pool),
            or a faiss index-factory string.
        nprobe / ef_search: search-time breadth of IVF / HNSW indexes.
    """

    def __init__(self, vectors: np.ndarray, spec: str = "auto", exact_max: int = 200_000, nprobe: int = 16,
                 ef_search: int = 128, train_max: int = 200_000, seed: int = 0):
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        n, d = self.vectors.shape
        if spec == "auto":
            spec = "flat" if n <= exact_max else f"IVF{int(4 * np.sqrt(n))},PQ{_pq_m(d)}"
        self.spec = spec
        try:
            index = faiss.IndexFlatL2(d) if spec == "flat" else faiss.index_factory(d, spec)
        except RuntimeError as exc:
            raise ToolchainError(f"curate.index '{spec}' is not a faiss index-factory string: {exc}") from None
        self.on_gpu = _gpu_available()
        if self.on_gpu:
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            sample = self.vectors[rng.choice(n, min(n, train_max), replace=False)]
            index.train(sample)
        index.add(self.vectors)
        params = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
            try:
                params.set_index_parameter(index, name, value)
            except RuntimeError:
                pass  # the index has no such parameter
        self.index = index
        self._exact: Optional[faiss.Index] = None

    @property
    def exact(self) -> bool:
        return self.spec == "flat"

    def search(self, queries: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """(distances, ids), each (Q, k); distances are Euclidean (not squared)."""
        k = min(k, len(self.vectors))
        d2, ids = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return np.sqrt(np.maximum(d2, 0)), ids

    def recall(self, queries: np.ndarray, k: int, sample: int = 200, seed: int = 0) -> float:
        """recall@k of this index against exact search on up to ``sample`` of the queries (1.0 if exact)."""
        if self.exact:
            return 1.0
        rng = np.random.default_rng(seed)
        q = queries[rng.choice(len(queries), min(sample, len(queries)), replace=False)]
        k = min(k, len(self.vectors))
        if self._exact is None:
            self._exact = faiss.IndexFlatL2(self.vectors.shape[1])
            self._exact.add(self.vectors)
        _, truth = self._exact.search(np.ascontiguousarray(q, dtype=np.float32), k)
        _, got = self.search(q, k)
        hits = sum(len(set(a) & set(b)) for a, b in zip(truth.tolist(), got.tolist()))
        return hits / truth.size


def _pq_m(d: int) -> int:
    for m in (64, 48, 32, 24, 16, 8, 4, 2, 1):
        if d % m == 0 and d // m >= 4:
            return m
    return 1
