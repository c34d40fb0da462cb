"""The data fingerprint keys every stage: it must follow the bytes, not the files' times."""
from __future__ import annotations

import os
import shutil

import pytest

from vfm_toolchain import fingerprint
from vfm_toolchain.fingerprint import fingerprint_paths
from vfm_toolchain.prepare import PrepareData
from vfm_toolchain.recipe import Recipe

from tests.conftest import tiny_recipe


def _tree(root):
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.png").write_bytes(b"0123456789")
    (root / "b.jpg").write_bytes(b"abcdef")
    return root


def test_times_do_not_count_bytes_and_names_do(tmp_path):
    memo = tmp_path / "memo.sqlite"
    root = _tree(tmp_path / "data")
    before = fingerprint_paths([str(root)], memo)
    os.utime(root / "a" / "x.png", ns=(1, 1))  # a re-copy without -p: new times, same bytes
    assert fingerprint_paths([str(root)], memo) == before

    (root / "a" / "x.png").write_bytes(b"0123456780")  # same size, one byte relabelled
    edited = fingerprint_paths([str(root)], memo)
    assert edited != before
    (root / "a" / "x.png").rename(root / "a" / "y.png")
    assert fingerprint_paths([str(root)], memo) != edited
    (root / "c.jpg").write_bytes(b"new")
    assert fingerprint_paths([str(root)], memo) not in (before, edited)


def test_memo_spares_the_reading_and_a_new_stat_reads_again(tmp_path, monkeypatch):
    memo = tmp_path / "memo.sqlite"
    root = _tree(tmp_path / "data")
    first = fingerprint_paths([str(root)], memo)
    assert memo.is_file()

    def no_reading(path):
        raise AssertionError(f"{path} was read although its stat is in the memo")

    monkeypatch.setattr(fingerprint, "sha256_file", no_reading)
    assert fingerprint_paths([str(root)], memo) == first
    os.utime(root / "b.jpg", ns=(5, 5))
    with pytest.raises(AssertionError, match="b.jpg"):  # the memo does not trust a changed stat
        fingerprint_paths([str(root)], memo)


def test_without_a_writable_memo_it_still_fingerprints(tmp_path):
    root = _tree(tmp_path / "data")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert fingerprint_paths([str(root)], blocker / "memo.sqlite") == fingerprint_paths([str(root)],
                                                                                       tmp_path / "m.sqlite")


def test_recopied_data_keeps_the_prepare_key(tiny_task, tmp_path, monkeypatch):
    monkeypatch.setenv("VFM_TOOLCHAIN_CACHE", str(tmp_path / "store"))
    src = tmp_path / "copy"
    task = {k: str(src / k) for k in ("train", "val", "test")}
    for k in task:
        shutil.copytree(tiny_task[k], task[k], copy_function=shutil.copy)  # bytes only: every mtime is new
    recipe = Recipe.model_validate(tiny_recipe({**task, "pools": tiny_task["pools"]}))
    key = PrepareData().config(recipe)
    shutil.rmtree(src)
    for k in task:
        shutil.copytree(tiny_task[k], task[k], copy_function=shutil.copy)
    for f in (src / "train").rglob("*.png"):
        os.utime(f, ns=(7, 7))
    assert PrepareData().config(recipe) == key
    victim = next((src / "train").rglob("*.png"))
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")
    assert PrepareData().config(recipe) != key
