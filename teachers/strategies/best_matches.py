"""``best_matches``: rank pool images by their distance to the closest query, take the first N.

The pool is read a block at a time and only the best N so far are kept, so memory follows the budget,
not the pool.
"""
import numpy as np

from vfm_toolchain.teachers.strategies.base import STRATEGIES, Selection, nearest_queries


@STRATEGIES.register("best_matches", source="seed 004 sec. 3.5")
def select_best_matches(query_emb, pool, budget, rng) -> Selection:
    ids = np.empty(0, np.int64)
    dist = np.empty(0, np.float32)
    qs = np.empty(0, np.int64)
    for gids, block in pool.vectors.chunks(pool.block_rows, pool.ids):
        d, q = nearest_queries(query_emb, block)
        ids, dist, qs = np.concatenate([ids, gids]), np.concatenate([dist, d]), np.concatenate([qs, q])
        if len(ids) > budget:  # keep the best N; ties resolved by pool order, as a full sort would
            order = np.lexsort((ids, dist))[:budget]
            ids, dist, qs = ids[order], dist[order], qs[order]
    order = np.lexsort((ids, dist))
    return Selection(ids[order], dist[order], qs[order])
