"""Sharded, resumable pool embedding."""
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from vfm_toolchain.teachers.embed import embed_sharded, load_shards
from vfm_toolchain.teachers.model import create_teacher, embed_features
from vfm_toolchain.recipe import AdapterConfig


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return create_teacher("timm:vit_tiny_patch16_224", "none", 32, 2, AdapterConfig(name="linear")).eval()


def _paths(tiny_task):
    return sorted(str(p) for p in Path(tiny_task["pools"][0]).glob("*.png"))[:23]


def test_shards_match_a_single_pass_and_resume_after_a_kill(tiny_task, tmp_path, encoder):
    paths = _paths(tiny_task)
    pp = encoder.backbone.preprocess
    ref = embed_features(encoder, paths, pp, normalize=True).numpy()
    assert embed_sharded(encoder, paths, pp, tmp_path / "e", shard_size=5) == 5
    assert np.allclose(load_shards(tmp_path / "e", len(paths)).take(np.arange(len(paths))), ref, atol=1e-5)
    # a "killed" run: shard 3 never finished; the rerun computes only that shard
    (tmp_path / "e" / "emb_00003.npy").unlink()
    with pytest.raises(FileNotFoundError, match="not finished"):
        load_shards(tmp_path / "e")
    assert embed_sharded(encoder, paths, pp, tmp_path / "e", shard_size=5, log=logging.getLogger("t")) == 1
    assert np.allclose(load_shards(tmp_path / "e", len(paths)).take(np.arange(len(paths))), ref, atol=1e-5)


def test_decoding_workers_embed_the_same_vectors(tiny_task, tmp_path, encoder):
    """The device policy's loader workers (data.workers) decode in other processes; the vectors are the same."""
    from vfm_toolchain import devices

    paths, pp = _paths(tiny_task), encoder.backbone.preprocess
    with devices.use("cpu", workers=0):
        embed_sharded(encoder, paths, pp, tmp_path / "w0", shard_size=8, batch_size=4)
    with devices.use("cpu", workers=2):
        assert devices.loader_kwargs()["num_workers"] == 2
        embed_sharded(encoder, paths, pp, tmp_path / "w2", shard_size=8, batch_size=4)
    a, b = (load_shards(tmp_path / w, len(paths)).take(np.arange(len(paths))) for w in ("w0", "w2"))
    assert np.array_equal(a, b)


def test_ranks_embed_disjoint_shards_that_together_cover_the_pool(tiny_task, tmp_path, encoder):
    paths = _paths(tiny_task)
    pp = encoder.backbone.preprocess
    done0 = embed_sharded(encoder, paths, pp, tmp_path / "e", shard_size=4, rank=0, world=2)
    files0 = set(p.name for p in (tmp_path / "e").glob("emb_*.npy"))
    done1 = embed_sharded(encoder, paths, pp, tmp_path / "e", shard_size=4, rank=1, world=2)
    files1 = set(p.name for p in (tmp_path / "e").glob("emb_*.npy")) - files0
    assert (done0, done1) == (3, 3) and not files0 & files1
    assert load_shards(tmp_path / "e", len(paths)).shape[0] == len(paths)
