"""Pool search: exact and approximate faiss indexes, and recall measured against exact search."""
import numpy as np
import pytest

from teachers.search import PoolIndex
from toolchain.errors import ToolchainError


def _clustered(n=4000, d=32, centres=40, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centres, d)) * 4
    x = c[rng.integers(0, centres, n)] + rng.normal(size=(n, d))
    q = c[rng.integers(0, centres, 100)] + rng.normal(size=(100, d))
    return x.astype(np.float32), q.astype(np.float32)


def test_flat_is_exact_and_auto_is_flat_for_small_pools():
    x, q = _clustered(500)
    idx = PoolIndex(x, "auto")
    assert idx.spec == "flat" and idx.recall(q, 10) == 1.0
    d, ids = idx.search(q, 5)
    brute = np.argsort(((q[:, None] - x[None]) ** 2).sum(-1), axis=1)[:, :5]
    assert (ids == brute).mean() > 0.99 and np.all(np.diff(d, axis=1) >= -1e-5)


@pytest.mark.parametrize("spec,nprobe,minimum", [("IVF64,Flat", 64, 0.999), ("IVF64,Flat", 1, 0.0), ("HNSW16", 1, 0.8)])
def test_approximate_recall_is_measured(spec, nprobe, minimum):
    x, q = _clustered()
    idx = PoolIndex(x, spec, nprobe=nprobe)
    r = idx.recall(q, 20, sample=100)
    assert 0 <= r <= 1 and r >= minimum
    if nprobe == 1 and spec.startswith("IVF"):
        assert r < PoolIndex(x, spec, nprobe=64).recall(q, 20, sample=100)  # fewer lists, lower recall


def test_auto_switches_to_an_approximate_index_above_exact_max():
    x, q = _clustered(3000)
    idx = PoolIndex(x, "auto", exact_max=1000)
    assert idx.spec.startswith("IVF") and idx.recall(q, 10) > 0.3


def test_bad_index_string():
    with pytest.raises(ToolchainError, match="index-factory"):
        PoolIndex(np.zeros((10, 4), np.float32), "NotAnIndex")
