"""The store shared and checked: concurrent builds, damaged entries rebuilt, a moved store, clean entries,
and ``toolchain store`` (list, verify, gc)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from typer.testing import CliRunner

from tests.conftest import stage_statuses, tiny_recipe
from vfm_toolchain.cli import app
from vfm_toolchain.core.files import DIR_MODE, FILE_MODE
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.stage import PIPELINE
from vfm_toolchain.store import ArtifactStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _statuses(record):
    return stage_statuses(record)


def _raw(tiny_task, **kw):
    return tiny_recipe(tiny_task, **{"bench.runtimes": ["onnxruntime"], "bench.batch_sizes": [1], **kw})


def test_concurrent_builds_on_one_store_all_succeed_and_each_stage_is_built_once(tiny_task, tmp_path):
    """The issue's reproduction: the same build started again while the first runs, on the same store; once
    into another output folder (per-key locks), once into the same one (the second waits for the first)."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_raw(tiny_task)))
    store = tmp_path / "store"
    env = {**os.environ, "VFM_PLAIN_PROGRESS": "1"}

    def start(out):
        return subprocess.Popen([sys.executable, "-m", "vfm_toolchain.cli", "build", str(path), "--store", str(store),
                                 "--out", str(tmp_path / out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = start("a")
    deadline = time.time() + 120
    while time.time() < deadline and not list(store.glob("teacher.finetune/*.partial")):
        time.sleep(0.1)  # the second starts while the first trains its teacher
    second, same_out = start("b"), start("a")
    outs = [p.communicate(timeout=600)[0] for p in (first, second, same_out)]
    for p, out in zip((first, second, same_out), outs):
        assert p.returncode == 0, out[-3000:]
    assert "waiting: another build is working on this stage" in outs[1]
    assert "another build is writing to" in outs[2]
    assert set(_statuses(json.loads((tmp_path / "a" / "build.json").read_text())).values()) == {"cached"}
    built = [n for n in PIPELINE if n not in ("student.select", "student.qat")]  # named student, no QAT: skipped
    for name in built:  # every stage ran in exactly one of the first two builds, never in the third
        ran = [i for i, out in enumerate(outs) if f" {name}] running in" in out]
        assert len(ran) == 1 and ran[0] in (0, 1), (name, ran)
    assert set(_statuses(json.loads((tmp_path / "b" / "build.json").read_text())).values()) <= {"ran", "cached"}
    s = ArtifactStore(store)
    sealed = [e for e in s.entries() if e.state == "sealed"]
    assert len(sealed) == len(built) and all(not s.verify(e.stage, e.key, full=True) for e in sealed)
    assert not [e for e in s.entries() if e.state != "sealed"]
    manifest = next(store.glob("teacher.curate/*/manifest.csv"))
    assert len(manifest.read_text().splitlines()) == 1 + 24


@pytest.fixture(scope="module")
def built(tiny_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharing")
    raw = _raw(tiny_task)
    record = build(recipe_from_dict(raw), root / "out", root / "store")
    return root, raw, record


def test_entries_are_clean_relocatable_and_readable(built):
    root, _, _ = built
    store = root / "store"
    for p in store.rglob("*"):
        if p.is_file() and not p.name.endswith((".lock", ".used")):
            assert not p.name.endswith(".tmp"), p
            assert stat.S_IMODE(p.stat().st_mode) == FILE_MODE, (p, oct(p.stat().st_mode))
            if p.suffix in (".json", ".csv", ".yaml", ".md", ".txt"):
                assert str(store) not in p.read_text(), f"{p} names the store by absolute path"
    for p in (root / "out").iterdir():
        if p.is_file() and p.suffix in (".json", ".md", ".png", ".yaml", ".log"):
            assert stat.S_IMODE(p.stat().st_mode) == FILE_MODE, p
    assert (root / "out" / "build.log").stat().st_size > 0


def _damaged_copy(root: Path, tmp_path: Path) -> Path:
    """A copy of the built store with two entries damaged: the shipped ONNX cut short, a result file gone."""
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    onnx = next(store.glob("export.convert/*/student/onnx/model.onnx"))
    with open(onnx, "r+b") as fh:
        fh.truncate(100)
    next(store.glob("student.finetune/*/result.json")).unlink()
    return store


def test_damaged_entries_are_reported_and_rebuilt_never_served(built, tmp_path):
    root, raw, _ = built
    store = _damaged_copy(root, tmp_path)
    weights = next(store.glob("teacher.finetune/*/model/weights.safetensors"))
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["build", str(p), "--store", str(store), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert res.output.count("is damaged") == 3
    st = _statuses(json.loads((tmp_path / "out" / "build.json").read_text()))
    assert st["teacher.finetune"] == st["student.finetune"] == st["export.convert"] == "ran"
    assert st["data.prepare"] == st["teacher.curate"] == st["student.distill"] == "cached"
    s = ArtifactStore(store)
    assert all(not s.verify(e.stage, e.key, full=True) for e in s.entries() if e.state == "sealed")
    assert len([e for e in s.entries() if e.state == "damaged"]) == 3

    res = runner.invoke(app, ["store", "--store", str(store), "--gc"])
    assert res.exit_code == 0 and "deleted 3 entries" in res.output
    assert not [e for e in s.entries() if e.state != "sealed"]


def test_verify_sets_damaged_entries_aside_so_the_next_build_rebuilds_them(built, tmp_path):
    root, raw, _ = built
    store = _damaged_copy(root, tmp_path)

    res = runner.invoke(app, ["store", "--store", str(store), "--verify"])
    assert res.exit_code == 1 and "model.onnx is 100 bytes" in res.output and "2 damaged" in res.output
    assert res.output.count("set aside as") == 2
    s = ArtifactStore(store)
    assert len([e for e in s.entries() if e.state == "damaged"]) == 2
    res = runner.invoke(app, ["store", "--store", str(store), "--verify"])
    assert res.exit_code == 0 and "all verified" in res.output  # what is left is whole

    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["build", str(p), "--store", str(store), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0 and "is damaged" not in res.output, res.output
    st = _statuses(json.loads((tmp_path / "out" / "build.json").read_text()))
    assert st["student.finetune"] == st["export.convert"] == "ran" and st["teacher.finetune"] == "cached"
    res = runner.invoke(app, ["store", "--store", str(store), "--gc"])
    assert res.exit_code == 0 and "deleted 2 entries" in res.output


def test_a_moved_store_still_builds(tiny_task, tmp_path):
    """Generated (synthetic) data lives inside the store; nothing may point at the old location."""
    raw = _raw(tiny_task, data={"source": "synthetic", "synthetic": {
        "classes": 3, "labeled_per_class": 4, "val_per_class": 2, "test_per_class": 3, "pool_size": 30,
        "distractor_size": 6, "image_size": 32}}, **{"curate.budget": 16})
    build(recipe_from_dict(raw), tmp_path / "o1", tmp_path / "store", only=["teacher.curate"])
    os.rename(tmp_path / "store", tmp_path / "moved")
    for p in (tmp_path / "moved").rglob("*"):
        if p.is_file() and p.suffix in (".json", ".csv", ".yaml", ".md", ".txt"):
            assert str(tmp_path / "store") not in p.read_text(), p
    record = build(recipe_from_dict(raw), tmp_path / "o2", tmp_path / "moved")  # distill reads the manifest
    st = _statuses(record)
    assert st["teacher.curate"] == "cached" and st["student.distill"] == "ran" and st["export.convert"] == "ran"


def test_store_listing_and_gc_keep_what_a_build_holds(built, tmp_path):
    root, _, _ = built
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    res = runner.invoke(app, ["store", "--store", str(store)])
    assert res.exit_code == 0 and "teacher.finetune" in res.output and "tiny" in res.output
    held = store / "student.distill" / "aaaaaaaaaaaaaaaaaaaaaaaa.partial"
    free = store / "student.distill" / "bbbbbbbbbbbbbbbbbbbbbbbb.partial"
    for d in (held, free):
        d.mkdir()
        (d / "train_state.pt").write_bytes(b"x" * 10)
    with FileLock(str(store / "student.distill" / "aaaaaaaaaaaaaaaaaaaaaaaa.lock")):
        res = runner.invoke(app, ["store", "--store", str(store), "--gc"])
    assert res.exit_code == 0 and "deleted 1 entries" in res.output
    assert held.exists() and not free.exists()
    res = runner.invoke(app, ["store", "--store", str(store), "--gc", "--older-than", "0", "--dry-run"])
    assert "would delete" in res.output and (store / "report").exists()
    res = runner.invoke(app, ["store", "--store", str(store), "--older-than", "3"])
    assert res.exit_code == 2 and "--older-than goes with --gc" in res.output


def test_a_sealed_entry_is_never_replaced(built, tmp_path):
    root, _, _ = built
    store = tmp_path / "store"
    shutil.copytree(root / "store", store)
    s = ArtifactStore(store)
    entry = next(e for e in s.entries() if e.stage == "report")
    before = (entry.path / "DONE").read_text()
    work = s.begin("report", entry.key)  # a build that did not take the lock finishes the same key
    (work / "result.json").write_text("{}")
    assert s.commit("report", entry.key, {"stage": "report"}) == entry.path
    assert (entry.path / "DONE").read_text() == before and not work.exists()


def test_sealing_drops_interrupted_writes_and_makes_library_files_readable(tmp_path):
    import tempfile

    s = ArtifactStore(tmp_path / "store")
    work = s.begin("export.convert", "k" * 64)
    (work / "result.json").write_text("{}")
    fd, private = tempfile.mkstemp(dir=work, suffix=".mlmodel")  # what coremltools leaves: 0600
    os.write(fd, b"weights")
    os.close(fd)
    sub = Path(tempfile.mkdtemp(dir=work))  # 0700
    (work / ".model.onnx.123.tmp").write_bytes(b"")  # an atomic write killed before its rename
    final = s.commit("export.convert", "k" * 64, {"stage": "export.convert"})
    assert not list(final.rglob("*.tmp"))
    assert stat.S_IMODE((final / Path(private).name).stat().st_mode) == FILE_MODE
    assert stat.S_IMODE((final / sub.name).stat().st_mode) == DIR_MODE
    assert json.loads((final / "DONE").read_text())["files"][Path(private).name]["bytes"] == 7
    assert not s.verify("export.convert", "k" * 64, full=True)
