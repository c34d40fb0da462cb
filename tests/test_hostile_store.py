"""The store and the output folder under hostile but realistic use (issue 36): nothing a build finished is lost,
and nothing goes wrong silently.

Each test copies the finished tiny build of ``hostile_env`` (its store and output folder) before it does
anything to it.  A full disk is a real one (a small tmpfs in a private mount namespace, ``unshare -rm``);
a running build is a real process, stopped with a real SIGTERM.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from tests.conftest import stage_statuses, tiny_recipe
from tests.hostile import BASE, check_answer, recipe
from vfm_toolchain.cli import app
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.store import ArtifactStore, sha256_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture
def own(env, tmp_path):
    """A private copy of the finished build: its store and its output folder (links kept as links)."""
    store, out = tmp_path / "store", tmp_path / "out"
    shutil.copytree(env.store, store)
    shutil.copytree(env.out, out, symlinks=True)
    return store, out


def _record(out: Path) -> dict:
    return json.loads((out / "build.json").read_text())


def _shipped_onnx(out: Path) -> Path:
    a = next(a for a in _record(out)["artifacts"] if a["kind"] == "onnx" and a["status"] == "ok")
    return out / a["path"]


def _assert_whole(out: Path) -> None:
    """The folder shows one complete build: its record, report and artifacts agree, the model parses."""
    record = _record(out)
    assert record["status"] == "complete"
    for a in record["artifacts"]:
        if a.get("status") == "ok":
            assert sha256_file(out / a["path"]) == a["sha256"], a["path"]
    onnx.checker.check_model(onnx.load(str(_shipped_onnx(out))))
    assert (out / "report.md").resolve().parent == (out / "build.json").resolve().parent


# ---- publishing: the output folder switches whole, or not at all


def test_a_killed_publish_leaves_the_last_build_whole(env, own, monkeypatch):
    store, out = own
    before = _record(out)
    onnx_before = _shipped_onnx(out).read_bytes()
    copies = []

    def killed_half_way(src, dst, *a, **kw):  # the copy of the artifacts dies after the first file
        copies.append(dst)
        Path(dst).mkdir(parents=True)
        first = next(p for p in Path(src).rglob("*") if p.is_file())
        (Path(dst) / first.name).write_bytes(first.read_bytes()[:1000])
        raise KeyboardInterrupt

    monkeypatch.setattr("vfm_toolchain.runner.shutil.copytree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        build(recipe_from_dict(tiny_recipe(env.task, **{**BASE, "finetune.epochs": 2})), out, store)
    assert copies, "the build never reached publishing"
    _assert_whole(out)
    assert _record(out)["stages"] == before["stages"] and _shipped_onnx(out).read_bytes() == onnx_before
    attempts = sorted((out / "builds").iterdir())
    assert json.loads((attempts[-1] / "build.json").read_text())["status"] == "interrupted"


def test_a_failed_rebuild_keeps_the_last_good_output_and_says_where_its_record_is(env, own, tmp_path):
    store, out = own
    before = (out / "build.json").read_bytes()
    res = runner.invoke(app, ["build", recipe(env, **{"export.parity_atol": 1e-30}), "--store", str(store),
                              "--out", str(out)])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "this build's record:" in res.output and "still shows the last complete build" in res.output
    failed = Path(res.output.split("this build's record: ")[1].split(";")[0].strip().replace("\n", ""))
    assert json.loads(failed.read_text())["status"] == "failed"
    assert (out / "build.json").read_bytes() == before
    _assert_whole(out)
    res = runner.invoke(app, ["bench", str(out), "--bundle", str(tmp_path / "bundle"), "--test-images", "4"])
    assert res.exit_code == 0, res.output


def test_an_output_folder_of_an_older_toolchain_is_adopted_whole(env, tmp_path):
    """Files at the top (the layout before builds/) move into a build folder of their own, nothing lost."""
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for p in (env.out / "current").resolve().iterdir():  # the files as an older toolchain left them
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, legacy / p.name, **({"symlinks": True} if p.is_dir()
                                                                                  else {}))
    (legacy / "notes.txt").write_text("mine")
    onnx_before = _shipped_onnx(legacy).read_bytes()
    store = tmp_path / "store"
    shutil.copytree(env.store, store)
    record = build(recipe_from_dict(copy.deepcopy(env.raw)), legacy, store)
    assert set(stage_statuses(record).values()) == {"cached"}
    kept = [b for b in (legacy / "builds").iterdir() if b.name.endswith("-legacy")]
    assert len(kept) == 1 and _shipped_onnx(kept[0]).read_bytes() == onnx_before
    assert (legacy / "notes.txt").read_text() == "mine"
    _assert_whole(legacy)


# ---- the output folder and the store stay apart


@pytest.mark.parametrize("where", ["inside", "equal"])
def test_an_out_inside_the_store_is_refused(env, own, where):
    store, _ = own
    out = store / "runs" / "exp1" if where == "inside" else store
    res = runner.invoke(app, ["build", recipe(env), "--store", str(store), "--out", str(out)])
    check_answer(res.exit_code, res.output, 2, r"--out '.*' is inside the artifact store")
    assert not (store / "runs").exists()


def test_gc_and_verify_leave_folders_that_are_not_entries(env, own):
    store, out = own
    stray = store / "runs" / "exp1"  # e.g. a build's output copied into the store by hand
    shutil.copytree(out, stray, symlinks=True)
    (store / "student.distill" / "my-notes").mkdir()
    res = runner.invoke(app, ["store", "--store", str(store), "--verify"])
    assert res.exit_code == 0 and "all verified" in res.output, res.output
    assert "not a store entry (left alone)" in res.output and "exp1" in res.output
    res = runner.invoke(app, ["store", "--store", str(store), "--gc", "--older-than", "0"])
    assert res.exit_code == 0, res.output
    assert (stray / "builds").is_dir() and (store / "student.distill" / "my-notes").is_dir()
    assert not [e for e in ArtifactStore(store).entries() if e.state == "sealed"]


def test_store_commands_do_not_create_a_missing_store(tmp_path):
    res = runner.invoke(app, ["store", "--store", str(tmp_path / "nowhere")])
    check_answer(res.exit_code, res.output, 2, r"there is no artifact store at '.*nowhere'")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("days", ["-1", "nan"])
def test_gc_refuses_a_negative_age(own, days):
    store, _ = own
    res = runner.invoke(app, ["store", "--store", str(store), "--gc", "--older-than", days])
    check_answer(res.exit_code, res.output, 2, r"--older-than .*: give a number of days >= 0")
    assert len(list(ArtifactStore(store).entries())) > 0


def test_gc_skips_what_a_build_reads(own):
    store, _ = own
    s = ArtifactStore(store)
    held = next(e for e in s.entries() if e.stage == "teacher.finetune")
    with s.lease(held.stage, held.key):
        gone, kept = s.gc(older_than_days=0)
    assert [e.key for e in kept] == [held.key] and held.path.is_dir()
    assert held.key not in {e.key for e in gone} and len(gone) > 0


def test_gc_during_a_running_build_then_sigterm_then_resume(env, own, tmp_path):
    """A real build in another process: gc keeps every entry it reads; SIGTERM stops it as Ctrl-C would (exit
    143, recorded interrupted); the same command resumes and finishes.  The build is held (SIGSTOP) from its first
    distillation checkpoint until the SIGTERM, so a few epochs leave gc the whole stage however slow this machine
    is, and the resume has little left to train."""
    store, _ = own
    out = tmp_path / "out2"
    path = recipe(env, **{"distill.epochs": 6})
    proc = subprocess.Popen([sys.executable, "-m", "vfm_toolchain.cli", "build", path, "--store", str(store),
                             "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        record = _wait_for_running(out, "student.distill", proc)
        proc.send_signal(signal.SIGSTOP)  # a stopped process keeps its flock leases, as a busy one does
        assert [s["status"] for s in record["stages"][:4]] == ["cached", "skipped", "cached", "cached"]
        res = runner.invoke(app, ["store", "--store", str(store), "--gc", "--older-than", "0"])
        assert res.exit_code == 0, res.output
        for stage in ("data.prepare", "teacher.finetune", "teacher.curate"):
            assert f"kept {stage}/" in res.output, res.output
        proc.send_signal(signal.SIGTERM)  # pending until it runs again
        proc.send_signal(signal.SIGCONT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    assert "terminated (SIGTERM)" in output and "Traceback" not in output
    record = _record(out)
    assert record["status"] == "interrupted"
    assert next(s for s in record["stages"] if s["name"] == "student.distill")["reason"].startswith(
        "interrupted (SIGTERM)")
    # the same command again, in this process: no signal is its subject (a process of its own would cost 10 s)
    res = runner.invoke(app, ["build", path, "--store", str(store), "--out", str(out)])
    assert res.exit_code == 0, res.output
    record = _record(out)
    distill = next(s for s in record["stages"] if s["name"] == "student.distill")
    assert record["status"] == "complete" and distill["status"] == "ran" and distill["resumed"]
    assert stage_statuses(record)["teacher.finetune"] == "cached"


def _wait_for_running(out: Path, stage: str, proc: subprocess.Popen, timeout: float = 300) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"the build ended before {stage} ran:\n{proc.stdout.read()}")
        for attempt in sorted((out / "builds").glob("*/build.json")) if (out / "builds").is_dir() else ():
            try:
                record = json.loads(attempt.read_text())
            except ValueError:
                continue
            last = record["stages"][-1] if record["stages"] else {}
            if last.get("name") == stage and last.get("status") == "running" and \
                    any((Path(record["store"]) / stage / f"{last['key']}.partial").glob("*.pt")):
                return record  # at work, with a checkpoint to resume from
        time.sleep(0.2)
    raise AssertionError(f"{stage} never started")


# ---- integrity: what is served is what was sealed


def test_same_size_corruption_of_weights_is_not_served(env, own, tmp_path):
    store, _ = own
    weights = next(store.glob("teacher.finetune/*/model/weights.safetensors"))
    with open(weights, "r+b") as fh:
        fh.seek(weights.stat().st_size // 2)
        fh.write(os.urandom(4096))
    res = runner.invoke(app, ["build", recipe(env), "--store", str(store), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "teacher.finetune" in res.output and "is damaged" in res.output and "weights.safetensors" in res.output
    st = stage_statuses(_record(tmp_path / "out"))
    assert st["teacher.finetune"] == "ran" and st["data.prepare"] == "cached"
    damaged = [e for e in ArtifactStore(store).entries() if e.state == "damaged"]
    assert [e.stage for e in damaged] == ["teacher.finetune"]


def test_large_files_are_checked_by_samples_and_by_mtime(tmp_path, monkeypatch):
    import vfm_toolchain.store as store_mod

    monkeypatch.setattr(store_mod, "_SAMPLED_ABOVE", 1 << 16)
    s = ArtifactStore(tmp_path / "store")
    key = "ab" * 32
    work = s.begin("teacher.curate", key)
    (work / "result.json").write_text("{}")
    big = work / "embeddings.npy"
    big.write_bytes(os.urandom(1 << 20))
    s.commit("teacher.curate", key, {"stage": "teacher.curate", "key": key})
    big = s.final_dir("teacher.curate", key) / "embeddings.npy"
    assert json.loads((big.parent / "DONE").read_text())["files"]["embeddings.npy"]["sampled_sha256"]
    assert s.verify("teacher.curate", key) == []
    with open(big, "r+b") as fh:  # a same-size write: a new mtime, so the whole file is hashed
        fh.seek(300_001)
        fh.write(b"\0" * 4096)
    assert s.verify("teacher.curate", key) == ["embeddings.npy changed since it was sealed (sha256 differs)"]


def test_verify_marks_an_entry_a_build_holds_and_the_next_build_rebuilds_it(env, own, tmp_path):
    store, _ = own
    s = ArtifactStore(store)
    weights = next(store.glob("teacher.finetune/*/model/weights.safetensors"))
    entry = next(e for e in s.entries() if e.stage == "teacher.finetune")
    with open(weights, "r+b") as fh:
        fh.write(b"\0" * 16)
    with s.lease(entry.stage, entry.key):  # a running build reads it
        res = runner.invoke(app, ["store", "--store", str(store), "--verify"])
    assert res.exit_code == 1 and "marked (a running build holds it)" in res.output
    assert [e.state for e in s.entries() if e.key == entry.key] == ["suspect"]
    res = runner.invoke(app, ["build", recipe(env), "--store", str(store), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0 and "is damaged" in res.output, res.output
    assert stage_statuses(_record(tmp_path / "out"))["teacher.finetune"] == "ran"


# ---- determinism: the same key, the same bytes, wherever the store lives


def test_two_stores_at_different_paths_give_identical_artifacts(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task, data={"source": "synthetic", "synthetic": {
        "classes": 3, "labeled_per_class": 4, "val_per_class": 2, "test_per_class": 3, "pool_size": 30,
        "distractor_size": 6, "image_size": 32}}, **{"curate.budget": 16, "teacher.epochs": 1, "distill.epochs": 1,
                                                      "bench.runtimes": []})  # timings differ run to run anyway
    records = [build(recipe_from_dict(raw), tmp_path / f"out{i}", tmp_path / f"place{i}" / "deeper" / "store")
               for i in (1, 2)]
    assert [s["key"] for s in records[0]["stages"]] == [s["key"] for s in records[1]["stages"]]
    shipped = [{a["path"]: a["sha256"] for a in r["artifacts"] if a.get("status") == "ok"} for r in records]
    assert shipped[0] and shipped[0] == shipped[1]
    assert records[0]["metrics"] == records[1]["metrics"]


# ---- the fingerprint memo lives in the store that was named


def test_the_fingerprint_memo_lives_in_the_named_store(env, tmp_path, monkeypatch):
    home = tmp_path / "default_store"
    monkeypatch.setenv("VFM_TOOLCHAIN_CACHE", str(home))
    store = tmp_path / "named"
    build(recipe_from_dict(copy.deepcopy(env.raw)), tmp_path / "out", store,
          only=["data.prepare"])
    assert (store / "fingerprints.sqlite").is_file() and not home.exists()


# ---- a full disk: a real one


@pytest.fixture(scope="module")
def tmpfs_ok(tmp_path_factory):
    probe = tmp_path_factory.mktemp("tmpfs_probe")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: cannot make a small disk for the disk-full cases")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1"', "sh", str(probe)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"this machine cannot mount a tmpfs in a user namespace: {res.stderr.strip()}")


# On the small disk, in one Python (a process for each build spent 10 s importing torch again): the first build
# publishes its output folder there, a file then fills the disk to 1.5 MB short, and the second build (other
# artifacts, built in the store, not on the small disk) cannot publish.
_PUBLISH_ON_A_FULL_DISK = """
import os, sys
from typer.testing import CliRunner
from vfm_toolchain.cli import app
first, second, store, disk = sys.argv[1:]
if CliRunner().invoke(app, ["build", first, "--store", store, "--out", disk + "/out"]).exit_code:
    sys.exit(91)
fs = os.statvfs(disk)
with open(disk + "/filler", "wb") as f:
    os.posix_fallocate(f.fileno(), 0, fs.f_bavail * fs.f_frsize - 1500000)
res = CliRunner().invoke(app, ["build", second, "--store", store, "--out", disk + "/out"])
print(res.output)
print(f"rc2={res.exit_code}")
"""


def test_disk_full_while_publishing_keeps_the_last_build(env, own, tmpfs_ok, tmp_path):
    store, _ = own
    disk, keep = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    first = recipe(env)
    second = recipe(env, **{"finetune.epochs": 2})
    script = 'mount -t tmpfs -o size=16m tmpfs "$1" && "$2" -c "$3" "$4" "$5" "$6" "$1" && cp -a "$1/out" "$7"'
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), sys.executable,
                          _PUBLISH_ON_A_FULL_DISK, first, second, str(store), str(keep)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    output = res.stdout + res.stderr
    assert "rc2=1" in output, output
    assert "disk full:" in output and "MB free at" in output and "Traceback" not in output, output
    assert "still shows the last complete build" in output
    _assert_whole(keep)
    assert stage_statuses(_record(keep))["student.finetune"] == "cached"  # the first build's record


def test_disk_full_in_a_stage_is_said_plainly(env, tmpfs_ok, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f'''
{sys.executable} -m vfm_toolchain.cli build {recipe(env)} --store {disk}/store --out {tmp_path}/out
echo "rc=$?"
'''
    res = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=6m tmpfs "$1" && sh -c "$2"', "sh",
                          str(disk), script], capture_output=True, text=True, cwd=REPO, timeout=600)
    output = res.stdout + res.stderr
    assert "rc=1" in output, output
    assert "disk full:" in output and "MB free at" in output, output
    assert "probably a bug" not in output and "Traceback" not in output, output
    assert json.loads((tmp_path / "out" / "build.json").read_text())["status"] == "failed"


def test_the_store_benchmark_runs(own):
    """docs/builds.md's command for the cost of a cache-hit check, at a tiny size (a broken benchmark fails here)."""
    store, _ = own
    res = subprocess.run([sys.executable, "-m", "benchmarks.store_bench", "--size-mb", "80", "--rounds", "1", "--store",
                          str(store)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "one 80 MB file: cache-hit check" in res.stdout and "sealed entries" in res.stdout
