"""``random``: a uniform sample of the pool (the baseline every curated set must beat)."""
import numpy as np

from vfm_toolchain.teachers.strategies.base import STRATEGIES, Selection, nearest_queries


@STRATEGIES.register("random", source="seed 004 sec. 3.5")
def select_random(query_emb, pool, budget, rng) -> Selection:
    idx = np.sort(rng.choice(pool.ids, size=budget, replace=False))
    dist, q = nearest_queries(query_emb, pool.vectors.take(idx))
    return Selection(idx, dist, q)
