"""Helpers for the hostile-use tests: a finished tiny build a user would not want to lose, and ways to aim the
real CLI at it with one thing wrong.

The build itself is the session fixture ``hostile_env`` (tests/conftest.py), made once for the whole run (the
pytest-xdist workers share it, each on a copy); each file that needs it names it ``env`` through a one-line fixture
of its own.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import yaml

from tests.conftest import tiny_recipe
from vfm_toolchain.store import ArtifactStore

__all__ = ["BASE", "make_env", "sealed", "recipe", "folder", "build_args", "text_file", "check_answer"]

BASE = {"bench.runtimes": ["onnxruntime"], "bench.batch_sizes": [1]}


def sealed(store: Path) -> set:
    return {(e.stage, e.key) for e in ArtifactStore(store).entries() if e.state == "sealed"}


def make_env(tiny_task: dict, root: Path, scratch: Optional[Path] = None) -> SimpleNamespace:
    """Copy the tiny task's data under ``root`` and build it once into ``root/store`` and ``root/out``, unless
    ``root/ready`` says an earlier call did.  With ``scratch`` (one per pytest-xdist worker, all of them reading
    the one build), the store and the output folder are copied there and every file the tests make goes there
    too: a worker's tests change nothing another worker reads, as when each built its own."""
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    data = root / "data"
    task = {"train": str(data / "train"), "val": str(data / "val"), "test": str(data / "test"),
            "pools": [str(data / "pool")]}
    raw = tiny_recipe(task, **BASE)
    if not (root / "ready").is_file():
        for name in ("data", "store", "out"):  # what a call that failed here left: the next starts afresh
            shutil.rmtree(root / name, ignore_errors=True)
        for split in ("train", "val", "test"):
            shutil.copytree(tiny_task[split], data / split)
        shutil.copytree(tiny_task["pools"][0], data / "pool")
        build(recipe_from_dict(raw), root / "out", root / "store")
        (root / "ready").touch()
    if scratch is None:
        scratch = root
    else:
        for name in ("store", "out"):
            shutil.copytree(root / name, scratch / name, symlinks=True)
    store = scratch / "store"
    return SimpleNamespace(root=scratch, store=store, out=scratch / "out", raw=raw, task=task, n=0,
                           sealed=sealed(store))


def recipe(env, **overrides) -> str:
    """The good recipe with ``overrides`` (dotted keys), written to a new file."""
    raw = tiny_recipe(env.task, **{**BASE, **overrides})
    env.n += 1
    path = env.root / f"recipe_{env.n}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def folder(env, name: str) -> Path:
    env.n += 1
    d = env.root / f"{name}_{env.n}"
    d.mkdir()
    return d


def build_args(env, recipe_path: str, *extra: str) -> List[str]:
    return ["build", recipe_path, "--store", str(env.store), "--out", str(folder(env, "out")), *extra]


def text_file(env, text: str, suffix: str = ".yaml") -> str:
    env.n += 1
    p = env.root / f"raw_{env.n}{suffix}"
    p.write_text(text)
    return str(p)


def check_answer(res_code: int, output: str, code: int, pattern: str) -> None:
    """One clear answer: no traceback, the exit code, a message matching ``pattern``."""
    assert "Traceback" not in output, output
    assert res_code == code, output
    assert re.search(pattern, output, re.S), f"expected /{pattern}/ in:\n{output}"
