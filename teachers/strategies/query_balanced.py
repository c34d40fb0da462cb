"""``query_balanced_image``: every labeled image brings in its own neighbours (seed 004 sec. 3.5).

Find the smallest k for which the union of all queries' k-NN holds at least N pool images; if it holds
more, drop the k-th neighbour of randomly chosen queries until exactly N remain.

One search at ``k_max`` serves every k: a pool image is in the union of k-NN lists iff its
first-occurrence rank (the smallest rank at which any query retrieves it) is below k, so the union sizes
for all k are a cumulative count of those ranks.  ``k_max`` doubles only when N is not reached.
"""
from __future__ import annotations

import numpy as np

from vfm_toolchain.teachers.strategies.base import STRATEGIES, Selection
from vfm_toolchain.errors import ToolchainError


def query_balanced_from_knn(ids: np.ndarray, dists: np.ndarray, n_pool: int, budget: int, rng):
    """Core of the strategy on a precomputed (Q, k_max) neighbour table; returns None if k_max is too small."""
    n_q, k_max = ids.shape
    valid = ids >= 0                                  # approximate indexes may return fewer than k (id -1)
    first = np.full(n_pool, k_max, dtype=np.int64)   # first-occurrence rank per pool image
    np.minimum.at(first, ids[valid], np.broadcast_to(np.arange(k_max), ids.shape)[valid])
    union_size = np.cumsum(np.bincount(first[first < k_max], minlength=k_max))  # |union of k-NN| for k = 1..k_max
    if union_size[-1] < budget:
        return None
    k = int(np.searchsorted(union_size, budget)) + 1     # smallest k with |union| >= N
    count = np.zeros(n_pool, dtype=np.int64)             # in how many truncated lists each image appears
    head = ids[:, :k]
    np.add.at(count, head[head >= 0], 1)
    keep = np.ones((n_q, k), dtype=bool)
    size = int((count > 0).sum())
    for q in rng.permutation(n_q):                       # drop k-th neighbours of random queries
        if size == budget:
            break
        item = ids[q, k - 1]
        keep[q, k - 1] = False
        if item < 0:
            continue
        count[item] -= 1
        if count[item] == 0:
            size -= 1
    # each selected image is attributed to the query (and distance) with the smallest rank that kept it
    sel_q = np.full(n_pool, -1, dtype=np.int64)
    sel_d = np.full(n_pool, np.inf)
    sel_r = np.full(n_pool, k, dtype=np.int64)
    for r in range(k):
        for q in range(n_q):
            if keep[q, r] and ids[q, r] >= 0:
                item = ids[q, r]
                if r < sel_r[item] or (r == sel_r[item] and dists[q, r] < sel_d[item]):
                    sel_q[item], sel_d[item], sel_r[item] = q, dists[q, r], r
    chosen = np.flatnonzero(sel_q >= 0)
    order = chosen[np.lexsort((sel_d[chosen], sel_r[chosen]))]
    return Selection(order, sel_d[order], sel_q[order])


@STRATEGIES.register("query_balanced_image", source="seed 004 sec. 3.5")
def select_query_balanced_image(query_emb, pool, budget, rng) -> Selection:
    usable = len(pool)  # global ids run up to len(pool.vectors); removed images are never returned
    k_max = min(usable, max(8, 2 * -(-budget // len(query_emb))))
    while True:
        dists, ids = pool.search(query_emb, k_max)
        sel = query_balanced_from_knn(ids, dists, len(pool.vectors), budget, rng)
        if sel is not None:
            return sel
        if k_max == usable:  # an approximate index that cannot return every neighbour
            raise ToolchainError(f"query-balanced selection reached only part of the budget {budget} with "
                                 f"curate.index '{pool.spec}'; set a larger curate.nprobe or use curate.index: flat")
        k_max = min(usable, 2 * k_max)


@STRATEGIES.register("query_balanced_text", source="seed 004 sec. 3.5", queries="text")
def select_query_balanced_text(query_emb, pool, budget, rng) -> Selection:
    """The same selection with text queries: ``query_emb`` holds one embedding per class, the mean of the
    class name in the prompt templates encoded by the OpenCLIP text tower (built by ``teacher.curate``)."""
    return select_query_balanced_image(query_emb, pool, budget, rng)
