"""Hostile data: input that used to be accepted without a word gets a clear answer (issue 36).

Refusals come before the first stage (exit 2, a message naming the problem and the fix, no traceback, nothing
built lost); an image that cannot be used is skipped and counted with its reason, in the log and in the data
index.  The refusal cases run with ``--only data.prepare`` so that, on code without the check, they finish in
seconds instead of running the whole build.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import List

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from tests.hostile import build_args, check_answer, folder, recipe, sealed
from vfm_toolchain.cli import app
from vfm_toolchain.data.pools import list_pool_source
from vfm_toolchain.data.synthetic import generate_segmentation_task
from vfm_toolchain.store import ArtifactStore

pytestmark = pytest.mark.slow
runner = CliRunner()
ONLY_PREPARE = ("--only", "data.prepare")


@pytest.fixture(scope="module")
def seg_task(tmp_path_factory) -> dict:
    """5 labeled image/mask pairs, 2 val, 2 test, 8 pool images; classes.txt: background + 2 shapes."""
    return generate_segmentation_task(tmp_path_factory.mktemp("seg"), 2, 5, 2, 2, 8, 0, 32, 0)


def seg_recipe(env, seg: dict, **overrides) -> str:
    return recipe(env, **{"data.task": "segmentation", "data.train": seg["train"], "data.val": seg["val"],
                          "data.test": seg["test"], "data.pools": seg["pools"], **overrides})


def refused(env, argv: List[str], pattern: str) -> str:
    """The CLI refuses ``argv`` before the first stage with exit 2 and a message matching ``pattern``."""
    res = runner.invoke(app, argv)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    check_answer(res.exit_code, res.output, 2, pattern)
    assert "[1/" not in res.output, f"a stage started before the refusal:\n{res.output}"
    assert sealed(env.store) == env.sealed  # nothing built was lost or replaced
    return res.output


def prepare_only(env, recipe_path: str, *extra: str):
    """``build --only data.prepare`` into a store of its own (the shared build's store must not change)."""
    store, out = folder(env, "store"), folder(env, "out")
    res = runner.invoke(app, ["build", recipe_path, "--store", str(store), "--out", str(out), *ONLY_PREPARE, *extra])
    return res, store, out


def prepare_index(store: Path) -> dict:
    entries = [e for e in ArtifactStore(store).entries() if e.stage == "data.prepare" and e.state == "sealed"]
    assert len(entries) == 1, entries
    return json.loads((entries[0].path / "index.json").read_text())


# ---------------------------------------------------------------------------------------------------
# 1. segmentation label budget larger than the labeled images


def test_segmentation_budget_above_the_pairs_is_refused(env, seg_task):
    refused(env, build_args(env, seg_recipe(env, seg_task, **{"data.labeled_per_class": 6}), *ONLY_PREPARE),
            r"data.labeled_per_class is 6 but the segmentation train folder '.*train' has 5 labeled image/mask "
            r"pairs.*Lower it to at most 5 or add")


def test_segmentation_budget_of_every_pair_without_val_is_refused(env, seg_task):
    refused(env, build_args(env, seg_recipe(env, seg_task, **{"data.labeled_per_class": 5, "data.val": None}),
                            *ONLY_PREPARE),
            r"data.labeled_per_class is 5, every labeled image/mask pair of .*train', which leaves no validation "
            r"images: give data.val, or lower data.labeled_per_class to at most 4")


def test_segmentation_pairs_without_a_mask_do_not_count_toward_the_budget(env, seg_task):
    train = folder(env, "seg_train")
    shutil.copytree(seg_task["train"], train, dirs_exist_ok=True)
    (train / "masks" / "00004.png").unlink()  # 4 labeled pairs left, and an image without a label
    refused(env, build_args(env, seg_recipe(env, seg_task, **{"data.train": str(train),
                                                                "data.labeled_per_class": 5}), *ONLY_PREPARE),
            r"has 4 labeled image/mask pairs \(1 image without a mask\).*at most 4")


def test_segmentation_budget_outside_labels_are_the_validation_set(env, seg_task):
    """As in classification: without data.val, the labels outside the budget are the validation set."""
    res, store, _ = prepare_only(env, seg_recipe(env, seg_task, **{"data.labeled_per_class": 3, "data.val": None}))
    assert res.exit_code == 0, res.output
    index = prepare_index(store)
    assert len(index["train"]) == 3 and len(index["val"]) == 2
    assert not {p for p, _ in index["train"]} & {p for p, _ in index["val"]}


# ---------------------------------------------------------------------------------------------------
# 2. classes.txt naming a class twice


def test_segmentation_classes_named_twice_are_refused(env, seg_task):
    train = folder(env, "seg_train")
    shutil.copytree(seg_task["train"], train, dirs_exist_ok=True)
    names = seg_task["classes"]
    (train / "classes.txt").write_text("\n".join([*names, "", names[1]]) + "\n")
    refused(env, build_args(env, seg_recipe(env, seg_task, **{"data.train": str(train)}), *ONLY_PREPARE),
            rf"'.*classes.txt' names '{names[1]}' twice \(lines 2 and 5\).*every class once")


# ---------------------------------------------------------------------------------------------------
# 3. images that cannot be used are skipped and counted with their reason


def write_blank_png(path: Path, width: int, height: int) -> Path:
    """A real single-channel PNG of ``width`` x ``height`` zero pixels, streamed through zlib row by row, so that a
    14000 x 14000 image costs a few hundred KB on disk and never 196 MB in memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    z, row, idat = zlib.compressobj(9), b"\x00" * (width + 1), []  # filter byte 0 + the row's bytes
    for _ in range(height):
        idat.append(z.compress(row))
    idat.append(z.flush())
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b""))
    return path


def train_with(env, name: str, make) -> Path:
    """A copy of the shared train folder with one extra image made by ``make(path)`` in its first class."""
    train = folder(env, "train")
    shutil.copytree(env.task["train"], train, dirs_exist_ok=True)
    return make(sorted(p for p in train.iterdir() if p.is_dir())[0] / name)


def test_a_decompression_bomb_sized_image_is_skipped_with_its_reason(env):
    big = train_with(env, "huge.png", lambda p: write_blank_png(p, 14000, 14000))
    res, store, out = prepare_only(env, recipe(env, **{"data.train": str(big.parents[1])}))
    assert res.exit_code == 0, res.output
    reason = (r"larger than the 178956970-pixel limit \(14000x14000 = 196000000 pixels\): a decompression-bomb "
              r"guard.*data.max_image_pixels")
    why = prepare_index(store)["corrupt"]["train"]
    assert list(why) == [str(big)] and re.search(reason, why[str(big)]), why
    log = (out / "build.log").read_text()
    assert re.search(r"train: 1 image skipped.*huge.png.*" + reason, log), log[-3000:]


def test_every_skipped_image_says_why(env):
    def broken(p):
        p.write_bytes(b"\x89PNG\r\n\x1a\n broken")
        return p

    bad = train_with(env, "broken.png", broken)
    res, store, out = prepare_only(env, recipe_path := recipe(env, **{"data.train": str(bad.parents[1])}))
    assert res.exit_code == 0, res.output
    why = prepare_index(store)["corrupt"]["train"]
    assert list(why) == [str(bad)] and why[str(bad)], why
    # reused, data.prepare says its warnings again: the skipped image is not forgotten on the second build
    again = runner.invoke(app, ["build", recipe_path, "--store", str(store), "--out", str(out), *ONLY_PREPARE])
    assert again.exit_code == 0, again.output
    assert re.search(r"data.prepare\] cached.*when it ran it warned 1 time.*train: 1 image skipped: '.*broken.png'",
                     again.output, re.S), again.output


def test_data_max_image_pixels_raises_or_lowers_the_limit(env):
    """A 64 x 64 image under a 2000-pixel limit is skipped with the value that would admit it; with the limit at
    that value it is used."""
    big = train_with(env, "big.png", lambda p: (Image.new("RGB", (64, 64), (200, 0, 0)).save(p), p)[1])
    train = str(big.parents[1])
    res, store, _ = prepare_only(env, recipe(env, **{"data.train": train, "data.max_image_pixels": 2000}))
    assert res.exit_code == 0, res.output
    why = prepare_index(store)["corrupt"]["train"]
    assert str(big) in why and "set data.max_image_pixels to at least 4096" in why[str(big)], why
    res, store, _ = prepare_only(env, recipe(env, **{"data.train": train, "data.max_image_pixels": 4096}))
    assert res.exit_code == 0, res.output
    index = prepare_index(store)
    assert not index["corrupt"]["train"] and str(big) in {p for p, _ in index["train"]}


def test_data_max_image_pixels_is_validated_and_part_of_the_key(env):
    from vfm_toolchain.prepare import PrepareData
    from vfm_toolchain.recipe import load_recipe

    refused(env, build_args(env, recipe(env, **{"data.max_image_pixels": 0}), *ONLY_PREPARE),
            r"'data.max_image_pixels': Input should be greater than or equal to 1")
    refused(env, build_args(env, recipe(env, **{"data.max_image_pixels": "big"}), *ONLY_PREPARE),
            r"'data.max_image_pixels': Input should be a valid integer")
    keys = [json.dumps(PrepareData().config(load_recipe(recipe(env, **extra))), sort_keys=True)
            for extra in ({}, {"data.max_image_pixels": 4096}, {"data.max_image_pixels": 8192})]
    assert len(set(keys)) == 3


# ---------------------------------------------------------------------------------------------------
# 4. NaN / inf rows in a precomputed-embedding pool


def precomputed_pool(env, bad_rows=(), dim: int = 8) -> Path:
    """The shared pool's images as a precomputed-embedding pool (paths.txt + one .npy), rows ``bad_rows`` not
    finite (NaN, then inf)."""
    pool = folder(env, "precomputed")
    images = list_pool_source(env.task["pools"][0])
    (pool / "paths.txt").write_text("\n".join(images) + "\n")
    emb = np.random.default_rng(0).standard_normal((len(images), dim)).astype(np.float32)
    for i, r in enumerate(bad_rows):
        emb[r, i % dim] = np.nan if i % 2 == 0 else np.inf
    np.save(pool / "emb_000.npy", emb)
    return pool


def precomputed_recipe(env, pool: Path) -> dict:
    """The recipe fields for a precomputed pool whose paths.txt names the shared pool's images where they are."""
    return {"data.pools": [str(pool)], "data.roots": env.task["pools"]}


def test_nan_embeddings_in_a_precomputed_pool_are_refused_before_the_first_stage(env):
    pool = precomputed_pool(env, bad_rows=(0, 5, 7, 9, 11, 13, 20))
    n = len(list_pool_source(str(pool), env.task["pools"]))
    refused(env, build_args(env, recipe(env, **precomputed_recipe(env, pool)), *ONLY_PREPARE),
            rf"embedding shard '.*emb_000.npy' has 7 of {n} rows that are not finite \(NaN or inf\): rows 0, 5, 7, "
            rf"9, 11, \.\.\. \(the embeddings of '.*\.png', .*re-embed those images, or remove")


def test_nan_embeddings_too_large_for_the_early_check_are_refused_by_data_prepare(env, monkeypatch):
    import vfm_toolchain.preflight as preflight

    monkeypatch.setattr(preflight, "EMBEDDING_CHECK_MAX_BYTES", 0)  # as if the shards were hundreds of GB
    pool = precomputed_pool(env, bad_rows=(3,))
    res, _, _ = prepare_only(env, recipe(env, **precomputed_recipe(env, pool)))
    check_answer(res.exit_code, res.output, 2,
                 r"stage 'data.prepare' failed: .*embedding shard '.*emb_000.npy' has 1 of \d+ rows that are not "
                 r"finite \(NaN or inf\): row 3 ")


def test_finite_precomputed_pool_passes(env):
    res, store, _ = prepare_only(env, recipe(env, **precomputed_recipe(env, precomputed_pool(env))))
    assert res.exit_code == 0, res.output
    assert all(r >= 0 for r in prepare_index(store)["pool_rows"])
