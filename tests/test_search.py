"""Pool search: exact and approximate faiss indexes, and recall measured against exact search."""
import numpy as np
import pytest

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.search import PoolIndex


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


# ---------------------------------------------------------------------------------------------------
# auto-tuned indexes (issue 17): the rule, tuning to a recall target, exact re-ranking, the GPU policy

def test_auto_rule_by_pool_size_and_memory():
    from vfm_toolchain.teachers.search import plan_index

    gib = 1 << 30
    assert plan_index(1000, 768, 8 * gib, exact_max=200_000).spec == "flat"
    fits = plan_index(1_000_000, 768, 8 * gib)  # 2.9 GiB of vectors
    assert fits.spec == "IVF4096,Flat" and not fits.refine and "fit" in fits.why
    big = plan_index(10_000_000, 768, 8 * gib)  # 28.6 GiB: PQ codes in memory, re-ranked from the pool
    assert big.spec == "IVF4096_HNSW32,PQ64" and big.refine and "exceed" in big.why  # 200k points train 4096 lists
    assert plan_index(10_000_000, 768, 8 * gib, train_max=1_000_000).spec == "IVF16384_HNSW32,PQ64"
    assert plan_index(1_000_000, 768, 1 * gib).spec == "IVF4096,PQ64"
    assert plan_index(300_000, 768, 8 * gib, hnsw_max=500_000).spec == "HNSW32"
    assert plan_index(4000, 32, gib, exact_max=1000).spec == "IVF64,Flat"  # >= 39 training points per list


def test_tuning_raises_breadth_until_the_recall_target():
    x, q = _clustered(6000, d=32, centres=60)
    idx = PoolIndex(x, "auto", exact_max=1000, nprobe=1)
    assert idx.kind == "ivf" and idx.recall(q, 50) < 0.9  # one list is not enough here: there is work to do
    tuning = idx.tune(q, 50, 0.95, sample=100)
    assert tuning["recall"] >= 0.95 and idx.recall(q, 50) >= 0.95
    assert [t["nprobe"] for t in tuning["trials"]] == [2 ** i for i in range(len(tuning["trials"]))]
    assert tuning["recall_low"] >= 0.95 and all(t["recall_low"] < 0.95 for t in tuning["trials"][:-1])
    assert idx.params["nprobe"] == tuning["params"]["nprobe"]
    assert idx.describe()["tuning"]["target"] == 0.95


def test_pq_candidates_reranked_from_the_pool_reach_recall_plain_pq_cannot():
    x, q = _clustered(6000, d=32, centres=60)
    small = PoolIndex(x, "auto", exact_max=1000, memory_gb=1e-6)  # the vectors "do not fit": PQ + re-ranking
    assert small.refine and ",PQ" in small.spec and small.knobs() == ["nprobe", "k_factor"]
    tuning = small.tune(q, 20, 0.95, sample=100)
    assert tuning["recall"] >= 0.95 and "k_factor" in tuning["params"]
    d, ids = small.search(q[:5], 20)
    exact = np.sqrt(((q[:5, None] - x[ids]) ** 2).sum(-1))
    assert np.allclose(d, exact, atol=1e-4) and np.all(np.diff(d, axis=1) >= -1e-6)  # true distances, sorted
    plain = PoolIndex(x, small.spec, nprobe=tuning["params"]["nprobe"])
    assert plain.recall(q, 20, sample=100) < tuning["recall"]  # the PQ approximation alone loses neighbours
    with pytest.raises(ToolchainError, match="min_recall"):
        PoolIndex(x, "IVF16,PQ4").tune(q, 20, 0.999, sample=100)  # 4-byte codes, no re-ranking: unreachable


def test_hnsw_tunes_ef_search():
    x, q = _clustered(3000, d=32, centres=30)
    idx = PoolIndex(x, "auto", exact_max=1000, hnsw_max=10_000, ef_search=16)
    assert idx.spec == "HNSW32" and idx.knobs() == ["efSearch"]
    tuning = idx.tune(q, 100, 0.97, sample=100)
    assert tuning["recall"] >= 0.97 and tuning["params"]["efSearch"] >= 16


def test_faiss_gpu_follows_the_device_policy(monkeypatch):
    import faiss
    import torch

    from vfm_toolchain import devices

    monkeypatch.setattr(faiss, "StandardGpuResources", object, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 2)
    assert devices.faiss_gpu(devices.DevicePolicy(torch.device("cpu"))) is None  # a CPU build searches on the CPU
    assert devices.faiss_gpu(devices.DevicePolicy(torch.device("cuda", 1))) == 1
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0)
    assert devices.faiss_gpu(devices.DevicePolicy(torch.device("cuda", 0))) is None  # faiss-cpu: no GPU index


@pytest.mark.gpu
def test_ivf_index_on_the_gpu_matches_its_cpu_twin():
    import faiss
    import torch

    from vfm_toolchain import devices

    if not torch.cuda.is_available() or not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        pytest.skip("needs CUDA and faiss-gpu (PyPI has no faiss-gpu wheel for torch's CUDA 13; docs/development.md, GPU / Docker)")
    x, q = _clustered(6000, d=32, centres=60)
    with devices.use("cuda"):
        gpu = PoolIndex(x, "IVF64,Flat")
        assert gpu.on_gpu and gpu.tune(q, 20, 0.95, sample=100)["recall"] >= 0.95
    cpu = PoolIndex(x, "IVF64,Flat", nprobe=gpu.params["nprobe"])
    assert np.mean(cpu.search(q, 20)[1] == gpu.search(q, 20)[1]) > 0.95
