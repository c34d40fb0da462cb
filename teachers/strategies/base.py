from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import faiss
import numpy as np

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry

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


def nearest_queries(query_emb: np.ndarray, vectors: np.ndarray):
    """For every given pool vector, its distance to the closest query and that query's index."""
    d, q = knn(query_emb, vectors, 1)
    return d[:, 0], q[:, 0]


def select_transfer_set(strategy: str, query_emb: np.ndarray, pool, budget: int, seed: int,
                        weights: Optional[np.ndarray] = None) -> Selection:
    """Run a registered strategy over ``pool``: a :class:`teachers.search.PoolIndex` (what the build passes:
    it knows which images are usable and how to search them), or raw embeddings, searched exactly.
    Indices in the returned selection are global pool indices.  ``weights``: each query's share of the budget,
    for strategies registered with ``weights=True`` (query_balanced_image); the others rank by distance or
    draw at random, where a share has no meaning, and ignore them."""
    from vfm_toolchain.teachers.search import PoolIndex

    if not isinstance(pool, PoolIndex):
        if len(pool) == 0:
            raise ToolchainError("the unlabeled pool is empty; add images to data.pools")
        pool = PoolIndex(pool, "flat")
    if len(query_emb) == 0:
        raise ToolchainError("no labeled images to use as retrieval queries")
    extra = {"weights": weights} if weights is not None and STRATEGIES.meta(strategy).get("weights") else {}
    return STRATEGIES.get(strategy)(query_emb, pool, min(budget, len(pool)), np.random.default_rng(seed), **extra)
