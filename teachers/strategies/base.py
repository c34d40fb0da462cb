from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from toolchain.errors import ToolchainError
from toolchain.registry import Registry

__all__ = ["STRATEGIES", "Selection", "select_transfer_set", "nearest_queries", "knn"]

STRATEGIES = Registry("strategy")


@dataclass
class Selection:
    indices: np.ndarray    # (N,) pool indices, in selection order
    distances: np.ndarray  # (N,) Euclidean distance to the query that brought each in
    queries: np.ndarray    # (N,) that query's index


def knn(index_vectors: np.ndarray, search_vectors: np.ndarray, k: int):
    """Exact Euclidean k-NN with faiss: for each search vector, its k nearest index vectors."""
    index = faiss.IndexFlatL2(index_vectors.shape[1])
    index.add(np.ascontiguousarray(index_vectors, dtype=np.float32))
    d2, ids = index.search(np.ascontiguousarray(search_vectors, dtype=np.float32), k)
    return np.sqrt(np.maximum(d2, 0)), ids


def nearest_queries(query_emb: np.ndarray, pool_emb: np.ndarray):
    """For every pool image, its distance to the closest query and that query's index."""
    d, q = knn(query_emb, pool_emb, 1)
    return d[:, 0], q[:, 0]


def select_transfer_set(strategy: str, query_emb: np.ndarray, pool_emb: np.ndarray, budget: int,
                        seed: int, pool_index=None) -> Selection:
    """Run a registered strategy; ``pool_index`` (a :class:`teachers.search.PoolIndex` over ``pool_emb``)
    serves the strategies that search the pool, exact search when omitted."""
    from teachers.search import PoolIndex

    if len(pool_emb) == 0:
        raise ToolchainError("the unlabeled pool is empty; add images to data.pools")
    if len(query_emb) == 0:
        raise ToolchainError("no labeled images to use as retrieval queries")
    pool_index = pool_index or PoolIndex(pool_emb, "flat")
    return STRATEGIES.get(strategy)(query_emb, pool_emb, min(budget, len(pool_emb)), np.random.default_rng(seed),
                                    pool_index)
