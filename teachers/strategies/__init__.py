"""Transfer-set selection strategies of seed 004 section 3.5, one file each.

Contract: ``select(query_emb, pool, budget, rng) -> Selection``; ``pool`` is a :class:`teachers.search.PoolIndex`
(``pool.search``, ``pool.ids`` of the usable images, ``pool.vectors``).  The selection holds global pool
indices in selection order, each with its distance to, and index of, the query that brought it in.  A strategy
registered with ``weights=True`` also takes ``weights=`` (one positive share of the budget per query, e.g. the
object crops of a rare class; None: equal shares), which ``select_transfer_set`` passes only to such strategies.
"""
from vfm_toolchain.teachers.strategies.base import STRATEGIES, Selection, select_transfer_set
from vfm_toolchain.teachers.strategies import random_strategy, best_matches, query_balanced  # noqa: F401  (register)

__all__ = ["STRATEGIES", "Selection", "select_transfer_set"]
