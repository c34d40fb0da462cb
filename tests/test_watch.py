"""What a person watching a build sees: stage lines from the first second, progress with an ETA, build.log,
one clear message for any failure (traceback only with -v and in build.log), and latency rows that are either
stable or say they are not."""
from __future__ import annotations

import errno
import json
import logging
import time

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from vfm_toolchain.export.runtimes.measure import measure_stable
from tests.conftest import tiny_recipe
from vfm_toolchain.cli import app
from vfm_toolchain.core.console import Track
from vfm_toolchain.failures import explain
from vfm_toolchain.prepare import PrepareData

runner = CliRunner()


@pytest.fixture
def recipe_file(tiny_task, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(tiny_recipe(tiny_task)))
    return p


def _build(recipe_file, tmp_path, *extra):
    return runner.invoke(app, ["build", str(recipe_file), "--store", str(tmp_path / "store"), "--out",
                               str(tmp_path / "out"), "--only", "data.prepare", *extra])


def test_stage_lines_show_without_flags_and_debug_with_v(recipe_file, tmp_path):
    res = _build(recipe_file, tmp_path)
    assert res.exit_code == 0, res.output
    assert "[1/11 data.prepare] running in" in res.output and "[3/11 teacher.finetune] skipped" in res.output
    assert "DEBUG" not in res.output
    log = (tmp_path / "out" / "build.log").read_text()
    assert "[1/11 data.prepare] running" in log and "DEBUG" in log  # the file has everything
    res = _build(recipe_file, tmp_path, "-v")
    assert res.exit_code == 0 and "[1/11 data.prepare] cached" in res.output and "DEBUG" in res.output


def test_plain_progress_lines_carry_count_rate_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="toolchain.progress")
    with Track("distill epoch 1/3", 30, unit="batch", interval=0) as bar:
        for _ in range(3):
            bar.set(loss=0.51234)
            bar.advance()
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("distill epoch 1/3: 1/30 batch (") and "batch/s" in lines[0]
    assert "ETA" in lines[0] and "loss 0.5123" in lines[0]
    assert lines[-1].startswith("distill epoch 1/3: 3/30 batch")


@pytest.mark.parametrize("exc,reason,fix", [
    (RuntimeError("boom"), "unexpected RuntimeError: boom", "probably a bug"),
    (MemoryError(), "the machine ran out of memory", "lower"),
    (OSError(errno.ENOSPC, "No space left on device", "/x/model.onnx"), "disk full:", "--gc"),
    (PermissionError(errno.EACCES, "Permission denied", "/x"), "permission denied", "--store and --out"),
    (ModuleNotFoundError("No module named 'tensorrt'", name="tensorrt"),
     "a package this stage needs is not installed (tensorrt)",
     "pip install tensorrt"),
])
def test_any_failure_is_one_message_and_a_failed_record(recipe_file, tmp_path, monkeypatch, exc, reason, fix):
    def fail(self, ctx):
        raise exc

    monkeypatch.setattr(PrepareData, "run", fail)
    res = _build(recipe_file, tmp_path)
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert f"stage 'data.prepare' failed: {reason}" in res.output and "fix:" in res.output and fix in res.output
    assert "full log:" in res.output
    record = json.loads((tmp_path / "out" / "build.json").read_text())
    entry = record["stages"][0]
    assert entry["status"] == "failed" and reason in entry["reason"] and entry["error"] == type(exc).__name__
    assert "Traceback" in (tmp_path / "out" / "build.log").read_text()
    res = _build(recipe_file, tmp_path, "-v")
    assert res.exit_code == 1 and "Traceback" in res.output


def test_ctrl_c_inside_a_stage_is_recorded_and_says_how_to_resume(recipe_file, tmp_path, monkeypatch):
    def interrupt(self, ctx):
        raise KeyboardInterrupt

    monkeypatch.setattr(PrepareData, "run", interrupt)
    res = _build(recipe_file, tmp_path)
    assert res.exit_code == 130 and "run the same command again to resume" in res.output
    record = json.loads((tmp_path / "out" / "build.json").read_text())
    assert record["stages"][0]["status"] == "interrupted"


def test_explain_keeps_user_errors_as_they_are():
    from vfm_toolchain.core.errors import ToolchainError

    failure = explain("teacher.finetune", ToolchainError("teacher.weights 'x' is not a file"))
    assert failure.user_error and failure.reason == "teacher.weights 'x' is not a file" and failure.fix is None
    oom = explain("student.distill", type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory"))
    assert "GPU ran out of memory" in oom.reason and "distill.batch_size" in oom.fix


class FakeClock:
    """``perf_counter`` for the runtime layer's measure.py that only moves when the timed function says so: the stability rule
    is tested on exact timings, not on this machine's load."""

    def __init__(self, durations_ms):
        self.now, self.calls, self.durations = 0.0, 0, durations_ms

    def perf_counter(self) -> float:
        return self.now

    def run(self, x) -> None:
        self.now += self.durations(self.calls) / 1e3
        self.calls += 1


@pytest.fixture
def clock(monkeypatch):
    def make(durations_ms):
        c = FakeClock(durations_ms)
        monkeypatch.setattr("vfm_toolchain.export.runtimes.measure.time.perf_counter", c.perf_counter)
        return c
    return make


def test_a_steady_row_is_measured_once(clock):
    c = clock(lambda i: 2.0 + 0.01 * (i % 3))
    row = measure_stable(c.run, np.zeros(1), warmup=1, iters=10)
    assert row["rounds"] == 1 and "unstable" not in row and row["p50_ms"] == pytest.approx(2.01)


def test_a_noisy_row_is_measured_again_then_flagged(clock):
    c = clock(lambda i: 20.0 if i % 5 == 4 else 1.0)  # every fifth call 20x slower: a competing process
    row = measure_stable(c.run, np.zeros(1), warmup=0, iters=10, repeats=3)
    assert row["rounds"] == 3 and row["unstable"].startswith("machine busy: cv")


def test_a_row_that_settles_keeps_the_steady_round(clock):
    c = clock(lambda i: 20.0 if i in (3, 7) else 1.0)  # busy during the first round only
    row = measure_stable(c.run, np.zeros(1), warmup=0, iters=10, repeats=3)
    assert row["rounds"] == 2 and "unstable" not in row and row["p99_ms"] == pytest.approx(1.0)
