"""Curation strategies against brute-force references (seed 004 sec. 3.5)."""
import numpy as np
import pytest

from vfm_toolchain.teachers.strategies import STRATEGIES, select_transfer_set
from vfm_toolchain.teachers.strategies.query_balanced import query_balanced_from_knn


def _brute_knn(pool, queries, k):
    d = ((queries[:, None, :] - pool[None, :, :]) ** 2).sum(-1)
    ids = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.sqrt(np.take_along_axis(d, ids, 1)), ids


def _naive_query_balanced(ids, budget, perm):
    """The definition, executed literally: grow k until the union reaches N, then drop k-th neighbours."""
    n_q, k_max = ids.shape
    for k in range(1, k_max + 1):
        if len(set(ids[:, :k].ravel())) >= budget:
            break
    lists = {q: list(ids[q, :k]) for q in range(n_q)}
    union = lambda: set(x for l in lists.values() for x in l)
    for q in perm:
        if len(union()) == budget:
            break
        lists[q] = lists[q][: k - 1]
    return union(), k


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ties", [False, True])
def test_query_balanced_matches_definition(seed, ties):
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(60, 4)).astype(np.float32)
    if ties:  # duplicated pool vectors: equal distances, several queries sharing neighbours
        pool[30:] = pool[:30]
        pool = np.round(pool, 1)
    queries = rng.normal(size=(int(rng.integers(2, 7)), 4)).astype(np.float32)
    budget = int(rng.integers(1, 50))
    dists, ids = _brute_knn(pool, queries, 60)
    sel = query_balanced_from_knn(ids, dists, len(pool), budget, np.random.default_rng(seed))
    perm = np.random.default_rng(seed).permutation(len(queries))
    expected, k = _naive_query_balanced(ids, budget, perm)
    assert len(sel.indices) == budget == len(set(sel.indices.tolist()))
    assert set(sel.indices.tolist()) == expected
    # every selected image was retrieved by the query it is attributed to, within the first k ranks
    for i, q, d in zip(sel.indices, sel.queries, sel.distances):
        assert i in ids[q, :k]
        assert np.isclose(d, np.linalg.norm(pool[i] - queries[q]), atol=1e-5)


def test_query_balanced_returns_none_when_kmax_is_too_small():
    ids = np.array([[0, 1], [0, 1]])
    assert query_balanced_from_knn(ids, np.zeros((2, 2)), 10, 3, np.random.default_rng(0)) is None


@pytest.mark.parametrize("name", STRATEGIES.list())
def test_every_strategy_selects_exactly_the_budget(name):
    rng = np.random.default_rng(0)
    pool, queries = rng.normal(size=(200, 8)), rng.normal(size=(5, 8))
    sel = select_transfer_set(name, queries, pool, 37, seed=0)
    assert len(sel.indices) == 37 == len(set(sel.indices.tolist()))
    assert sel.indices.max() < 200 and sel.queries.max() < 5


@pytest.mark.parametrize("name", STRATEGIES.list())
def test_budget_larger_than_pool_takes_everything(name):
    rng = np.random.default_rng(1)
    pool, queries = rng.normal(size=(20, 3)), rng.normal(size=(4, 3))
    sel = select_transfer_set(name, queries, pool, 500, seed=0)
    assert sorted(sel.indices.tolist()) == list(range(20))


def test_best_matches_prefers_images_near_queries():
    rng = np.random.default_rng(2)
    queries = rng.normal(size=(3, 4))
    near = queries.repeat(5, 0) + 0.01 * rng.normal(size=(15, 4))
    far = 10 + rng.normal(size=(50, 4))
    sel = select_transfer_set("best_matches", queries, np.concatenate([far, near]), 15, seed=0)
    assert sorted(sel.indices.tolist()) == list(range(50, 65))
    assert np.all(np.diff(sel.distances) >= 0)


@pytest.mark.parametrize("seed", range(6))
def test_weighted_query_balance_searches_only_as_deep_as_needed(seed):
    """Per-share searches, deepened only when a cut list could matter, select what full-depth lists select;
    a query's share of the budget is what it brings in, roughly."""
    from vfm_toolchain.teachers.search import PoolIndex
    from vfm_toolchain.teachers.strategies.query_balanced import weighted_query_balanced_from_knn

    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(300, 4)).astype(np.float32)
    queries = rng.normal(size=(6, 4)).astype(np.float32)
    weights = np.array([1, 1, 2, 2, 4, 8], dtype=float)
    budget = int(rng.integers(20, 200))
    sel = select_transfer_set("query_balanced_image", queries, pool, budget, seed, weights=weights)
    index = PoolIndex(pool, "flat")
    blocks = [(g, *index.search(queries[g], 300)[::-1]) for g in (np.flatnonzero(weights == v)
                                                                  for v in np.unique(weights))]
    full = weighted_query_balanced_from_knn(blocks, 300, budget, weights,
                                            np.random.default_rng(seed).permutation(6))
    assert np.array_equal(sel.indices, full.indices) and np.array_equal(sel.queries, full.queries)
    assert len(set(sel.indices.tolist())) == budget
    assert np.bincount(sel.queries, minlength=6)[5] > np.bincount(sel.queries, minlength=6)[0]
