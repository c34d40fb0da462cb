"""``random``: a uniform sample of the pool (the baseline every curated set must beat)."""
import numpy as np

from teachers.strategies.base import STRATEGIES, Selection, nearest_queries


@STRATEGIES.register("random", source="seed 004 sec. 3.5")
def select_random(query_emb, pool_emb, budget, rng, pool_index=None) -> Selection:
    idx = np.sort(rng.choice(len(pool_emb), size=budget, replace=False))
    dist, q = nearest_queries(query_emb, pool_emb[idx])
    return Selection(idx, dist, q)
