"""``best_matches``: rank pool images by their distance to the closest query, take the first N."""
import numpy as np

from teachers.strategies.base import STRATEGIES, Selection, nearest_queries


@STRATEGIES.register("best_matches", source="seed 004 sec. 3.5")
def select_best_matches(query_emb, pool_emb, budget, rng, pool_index=None) -> Selection:
    dist, q = nearest_queries(query_emb, pool_emb)
    order = np.argsort(dist, kind="stable")[:budget]
    return Selection(order, dist[order], q[order])
