"""Retrieval metrics of seed 000 (after Musgrave et al., "A metric learning reality check").

For a query with R other gallery items of its class, take its R nearest neighbours (itself excluded):

    R-Precision = (relevant among the R) / R
    MAP@R       = (1/R) * sum_{i=1..R} P(i) * rel(i),   P(i) = precision of the first i neighbours

Both are averaged over queries that have at least one other item of their class.
"""
from __future__ import annotations

from typing import Dict

import faiss
import numpy as np

__all__ = ["retrieval_metrics"]


def retrieval_metrics(embeddings: np.ndarray, labels: np.ndarray) -> Dict[str, float]:
    """MAP@R and R-Precision of a labeled set retrieved against itself by Euclidean distance."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    labels = np.asarray(labels)
    counts = {c: int((labels == c).sum()) for c in np.unique(labels)}
    r_max = max(counts.values()) - 1
    if r_max < 1:
        raise ValueError("retrieval metrics need at least two items of some class")
    index = faiss.IndexFlatL2(x.shape[1])
    index.add(x)
    _, ids = index.search(x, min(len(x), r_max + 1))
    maps, rps = [], []
    for q in range(len(x)):
        r = counts[labels[q]] - 1
        if r == 0:
            continue
        neigh = [i for i in ids[q] if i != q][:r]  # the query itself is not a result
        rel = (labels[neigh] == labels[q]).astype(np.float64)
        precision_at_i = np.cumsum(rel) / np.arange(1, r + 1)
        maps.append(float((precision_at_i * rel).sum() / r))
        rps.append(float(rel.sum() / r))
    return {"map_at_r": float(np.mean(maps)), "r_precision": float(np.mean(rps)), "queries": len(maps)}
