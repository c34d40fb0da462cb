"""``query_balanced_image``: every labeled image brings in its own neighbours (seed 004 sec. 3.5).

Find the smallest k for which the union of all queries' k-NN holds at least N pool images; if it holds
more, drop the k-th neighbour of randomly chosen queries until exactly N remain.

One search at ``k_max`` serves every k: a pool image is in the union of k-NN lists iff its
first-occurrence rank (the smallest rank at which any query retrieves it) is below k, so the union sizes
for all k are a cumulative count of those ranks.  ``k_max`` doubles only when N is not reached.

Weighted queries (detection: whole images and object crops, each class an equal share of the budget): each
query's list grows in proportion to its weight instead of all growing together.  The entry at rank r of query
q joins at level (r + 1) / w_q; entries join in level order (ties in a random query order, as the unweighted
rule drops k-th neighbours of random queries) until the union holds N images.  With equal weights this is the
rule above: every rank-r entry shares one level, and adding the last rank's entries in a random order until N
is reached keeps the same images as dropping them in the reverse order until N remain.
"""
from __future__ import annotations

import numpy as np

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.strategies.base import STRATEGIES, Selection


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


def weighted_query_balanced_from_knn(blocks, usable: int, budget: int, weights: np.ndarray, tie: np.ndarray):
    """The weighted rule (module docstring) on neighbour tables searched per group of queries: ``blocks`` is a
    list of (query indices (Q_g,), ids (Q_g, k_g), distances (Q_g, k_g)), a group's lists as deep as its share
    needs (one table as deep as the largest share would hold every query's list at that depth).  ``usable``:
    the pool images a search can return; ``tie``: a permutation of the queries that orders them where they join
    at one level.  None if a list is too short, i.e. a query whose list was cut would have joined before the
    N-th image did."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    q_parts, r_parts, item_parts, d_parts = [], [], [], []
    cut = np.inf  # the level at which the first entry beyond a cut list would have joined
    for qs, ids, dists in blocks:
        qq, rr = np.nonzero(ids >= 0)                     # row-major: per query, rank ascending
        q_parts.append(np.asarray(qs)[qq])
        r_parts.append(rr)
        item_parts.append(ids[qq, rr])
        d_parts.append(dists[qq, rr])
        k = ids.shape[1]
        full = (ids >= 0).sum(axis=1) == k                # a shorter list is all an approximate index returns
        if k < usable and full.any():
            cut = min(cut, float(((k + 1) / w[np.asarray(qs)[full]]).min()))
    q_of, r_of = np.concatenate(q_parts), np.concatenate(r_parts)
    items, dist = np.concatenate(item_parts), np.concatenate(d_parts)
    level = (r_of + 1) / w[q_of]
    order = np.lexsort((r_of, tie[q_of], level))
    uniq, first = np.unique(items[order], return_index=True)  # where each image joins the union first
    if len(uniq) < budget:
        return None
    joined = np.sort(first)[:budget]
    if level[order[joined[-1]]] >= cut:
        return None
    pick = order[joined]
    return Selection(items[pick], dist[pick], q_of[pick])


@STRATEGIES.register("query_balanced_image", source="seed 004 sec. 3.5", weights=True)
def select_query_balanced_image(query_emb, pool, budget, rng, weights=None) -> Selection:
    """``weights`` (one per query, optional): each query's share of the budget (see the module docstring)."""
    usable = len(pool)  # global ids run up to len(pool.vectors); removed images are never returned
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
        if len(weights) != len(query_emb) or not np.all(np.isfinite(weights)) or weights.min() <= 0:
            raise ToolchainError(f"query weights must be {len(query_emb)} positive numbers, one per query")
        if np.ptp(weights) == 0:
            weights = None  # equal shares: the unweighted rule, exactly
    if weights is not None:
        return _select_weighted(query_emb, pool, budget, rng, weights)
    k_max = min(usable, max(8, 2 * -(-budget // len(query_emb))))
    while True:
        dists, ids = pool.search(query_emb, k_max)
        sel = query_balanced_from_knn(ids, dists, len(pool.vectors), budget, rng)
        if sel is not None:
            return sel
        if k_max == usable:  # an approximate index that cannot return every neighbour
            raise ToolchainError(_short_message(budget, pool))
        k_max = min(usable, 2 * k_max)


def _short_message(budget: int, pool) -> str:
    return (f"query-balanced selection reached only part of the budget {budget} with curate.index '{pool.spec}'; "
            f"set a larger curate.nprobe or use curate.index: flat")


def _select_weighted(query_emb, pool, budget, rng, weights: np.ndarray) -> Selection:
    """Queries of one share (the whole images; one class's objects) are searched together, each group about
    twice as deep as its share of the budget, deeper only where the selection needs it."""
    usable = len(pool)
    tie = rng.permutation(len(query_emb))  # drawn once: the selection does not depend on how deep we searched
    shares = np.unique(weights)
    groups = [np.flatnonzero(weights == v) for v in shares]
    depth = [min(usable, max(8, 2 * int(np.ceil(budget * v / weights.sum())))) for v in shares]
    while True:
        blocks = []
        for qs, k in zip(groups, depth):
            dists, ids = pool.search(np.ascontiguousarray(query_emb[qs]), k)
            blocks.append((qs, ids, dists))
        sel = weighted_query_balanced_from_knn(blocks, usable, budget, weights, tie)
        if sel is not None:
            return sel
        if all(k == usable for k in depth):
            raise ToolchainError(_short_message(budget, pool))
        depth = [min(usable, 2 * k) for k in depth]


@STRATEGIES.register("query_balanced_text", source="seed 004 sec. 3.5", queries="text")
def select_query_balanced_text(query_emb, pool, budget, rng) -> Selection:
    """The same selection with text queries: ``query_emb`` holds one embedding per class, the mean of the
    class name in the prompt templates encoded by the OpenCLIP text tower (built by ``teacher.curate``)."""
    return select_query_balanced_image(query_emb, pool, budget, rng)
