"""k-NN search over an embedded pool with faiss: exact while the pool is small, an approximate index
(any faiss index-factory string: ``IVF1024,PQ32``, ``HNSW32``, ...) beyond, on GPU when faiss-gpu and
CUDA are present.  The recall of an approximate index is measured against exact search on a sample of
queries, so a build knows (and can demand) how much the speed cost.

The pool is a :class:`~teachers.vectors.PoolVectors` (memory-mapped shards) and is added to the index a
block at a time, so the raw embeddings never have to fit in memory: an IVF-PQ index keeps only its codes,
and exact search over a pool larger than ``memory_rows`` streams the shards through a running top-k.
Search results are global pool indices; ``keep`` leaves images out (duplicates, near-copies of val/test).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import faiss
import numpy as np

from teachers.vectors import PoolVectors
from toolchain.errors import ToolchainError

__all__ = ["PoolIndex"]


def _gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class PoolIndex:
    """Euclidean k-NN over the rows of ``vectors`` selected by ``keep``.

    Args:
        spec: 'flat' (exact), 'auto' (exact up to ``exact_max`` vectors, else IVF-PQ sized to the pool),
            or a faiss index-factory string.
        nprobe / ef_search: search-time breadth of IVF / HNSW indexes.
        memory_rows: an exact index holds at most this many vectors in memory; beyond, it streams.
        block_rows: vectors read from the shards per step.
    """

    def __init__(self, vectors: Union[np.ndarray, PoolVectors], spec: str = "auto", exact_max: int = 200_000,
                 nprobe: int = 16, ef_search: int = 128, train_max: int = 200_000, seed: int = 0,
                 keep: Optional[np.ndarray] = None, memory_rows: int = 2_000_000, block_rows: int = 65536):
        self.vectors = vectors if isinstance(vectors, PoolVectors) else PoolVectors.from_array(vectors)
        self.ids = (np.arange(len(self.vectors), dtype=np.int64) if keep is None
                    else np.flatnonzero(np.asarray(keep)).astype(np.int64))
        self.block_rows = block_rows
        n, d = len(self.ids), self.vectors.dim
        if n == 0:
            raise ToolchainError("the pool index has no vectors (every pool image was left out)")
        if spec == "auto":
            spec = "flat" if n <= exact_max else f"IVF{int(4 * np.sqrt(n))},PQ{_pq_m(d)}"
        self.spec = spec
        self.on_gpu = _gpu_available()
        self.streaming = spec == "flat" and n > memory_rows
        self.index: Optional[faiss.Index] = None
        if not self.streaming:
            self.index = self._build(spec, d, nprobe, ef_search, train_max, seed)

    def _build(self, spec, d, nprobe, ef_search, train_max, seed) -> faiss.Index:
        try:
            index = faiss.IndexFlatL2(d) if spec == "flat" else faiss.index_factory(d, spec)
        except RuntimeError as exc:
            raise ToolchainError(f"curate.index '{spec}' is not a faiss index-factory string: {exc}") from None
        if self.on_gpu:
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            sample = np.sort(rng.choice(self.ids, min(len(self.ids), train_max), replace=False))
            index.train(self.vectors.take(sample))
        for _, block in self.vectors.chunks(self.block_rows, self.ids):
            index.add(block)
        params = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
            try:
                params.set_index_parameter(index, name, value)
            except RuntimeError:
                pass  # the index has no such parameter
        return index

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def exact(self) -> bool:
        return self.spec == "flat"

    def search(self, queries: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """(distances, global ids), each (Q, k); distances are Euclidean (not squared); id -1 = not found."""
        k = min(k, len(self.ids))
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if self.streaming:
            return self._stream_exact(q, k)
        d2, local = self.index.search(q, k)
        return np.sqrt(np.maximum(d2, 0)), np.where(local >= 0, self.ids[np.maximum(local, 0)], -1)

    def _stream_exact(self, q: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Exact k-NN one block of shards at a time, merged in a running heap: memory ~ one block."""
        heap = faiss.ResultHeap(len(q), k)
        for gids, block in self.vectors.chunks(self.block_rows, self.ids):
            d2, local = faiss.knn(q, block, min(k, len(block)))
            heap.add_result(np.ascontiguousarray(d2), np.where(local >= 0, gids[np.maximum(local, 0)], -1))
        heap.finalize()
        return np.sqrt(np.maximum(heap.D, 0)), heap.I

    def recall(self, queries: np.ndarray, k: int, sample: int = 200, seed: int = 0) -> float:
        """recall@k of this index against exact search on up to ``sample`` of the queries (1.0 if exact)."""
        if self.exact:
            return 1.0
        rng = np.random.default_rng(seed)
        q = np.ascontiguousarray(queries[rng.choice(len(queries), min(sample, len(queries)), replace=False)],
                                 dtype=np.float32)
        k = min(k, len(self.ids))
        _, truth = self._stream_exact(q, k)
        _, got = self.search(q, k)
        hits = sum(len(set(a) & set(b)) for a, b in zip(truth.tolist(), got.tolist()))
        return hits / truth.size


def _pq_m(d: int) -> int:
    for m in (64, 48, 32, 24, 16, 8, 4, 2, 1):
        if d % m == 0 and d // m >= 4:
            return m
    return 1
