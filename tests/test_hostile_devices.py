"""Device results under hostile use (issue 36): a results.json is checked whole before anything is merged.

``toolchain report BUILD_OUT --device-results`` takes only the results of THIS build's bundle (each artifact by
name and sha256), with finite positive latencies and scores in [0, 1]; a refused merge leaves report.md and
build.json byte for byte.  ``student.target`` takes only the results of a candidates bundle, checked the same
way before the first stage of a build, and ``toolchain candidates`` reads it as the build does.

Every case runs the real CLI on results the real run_bench.py wrote (then spoiled the way a user would) and
asserts: exit code 2, no traceback, a message naming the entry, the field, the value and what is allowed.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
from typer.testing import CliRunner

from tests.conftest import tiny_recipe
from tests.hostile import BASE, build_args, check_answer, folder, recipe, sealed
from vfm_toolchain.cli import app

pytestmark = pytest.mark.slow
runner = CliRunner()
CANDIDATE = "timm:test_efficientnet"  # a small candidate student: exported and timed in seconds


def run_bench(bundle: Path) -> Dict:
    """The bundle's own runner, as on the device; its results.json."""
    out = subprocess.run([sys.executable, "run_bench.py", "--iters", "3", "--warmup", "1"], cwd=bundle,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((bundle / "results.json").read_text())


def copy_build(env) -> Path:
    """The finished build, copied (its stages stay links into the store): merges never touch hostile_env."""
    out = folder(env, "build_copy")
    shutil.copytree(env.out, out, symlinks=True, dirs_exist_ok=True)
    return out


@pytest.fixture(scope="module")
def build_results(hostile_env) -> Dict:
    """What run_bench.py wrote for the bundle of the hostile build (``toolchain bench OUT --bundle``)."""
    from vfm_toolchain.bench.bundle import write_bundle

    bundle = write_bundle(copy_build(hostile_env), folder(hostile_env, "build_bundle"))
    return run_bench(bundle)


@pytest.fixture(scope="module")
def candidate_results(hostile_env) -> Dict:
    """What run_bench.py wrote for a candidates bundle (``toolchain candidates RECIPE --bundle``)."""
    from vfm_toolchain.bench.select import write_candidate_bundle
    from vfm_toolchain.recipe import recipe_from_dict

    raw = tiny_recipe(hostile_env.task, **{**BASE, "student.name": "auto", "student.candidates": [CANDIDATE],
                                                 "student.budget_ms": 1e6})
    bundle = write_candidate_bundle(recipe_from_dict(raw), folder(hostile_env, "cand_bundle"), "onnx", None,
                                    logging.getLogger("test"))
    return run_bench(bundle)


def results_file(env, res) -> Path:
    env.n += 1
    f = env.root / f"device_results_{env.n}.json"
    f.write_text(res if isinstance(res, str) else json.dumps(res))
    return f


def spoil(res: Dict, change: Callable[[Dict], None]) -> Dict:
    res = json.loads(json.dumps(res))
    change(res)
    return res


def row(**fields) -> Callable[[Dict], None]:
    return lambda res: res["bench"][0].update(fields)


def accuracy(**fields) -> Callable[[Dict], None]:
    return lambda res: res["accuracy"][0].update(fields)


def drop(*keys: str) -> Callable[[Dict], None]:
    return lambda res: [res.pop(k) for k in keys]


def never_made(res: Dict) -> None:
    """A row for a LiteRT file the build never exported, with a sha256 of its own."""
    res["bench"].append({**res["bench"][0], "artifact": "student litert"})
    res["artifacts"]["student litert"] = "cd" * 32


def another_build(res: Dict) -> None:
    """The same artifact name from a bundle of another build: other bytes, another sha256."""
    res["artifacts"]["student onnx"] = "ab" * 32


def unnamed_artifact(res: Dict) -> None:
    res["bench"][0]["artifact"] = "student tflite"


ROW = r"bench\[0\] \(student onnx, batch 1\)"
REPORT_CASES: List[tuple] = [
    ("an artifact the build never made", never_made,
     r"'student litert'.*which the build .* did not make.*this build's artifacts: student onnx"),
    ("a row naming an artifact the bundle did not ship", unnamed_artifact,
     r"bench\[0\]: artifact is 'student tflite'.*one of the artifacts the results list: student onnx"),
    ("another build's results", another_build,
     r"'student onnx' was measured with sha256 abababababab.*this build's 'student onnx' has sha256 [0-9a-f]{12}"
     r".*another build"),
    ("negative latency", row(p50_ms=-1.5), ROW + r": p50_ms is -1.5; .*a finite number of milliseconds above 0"),
    ("NaN latency", row(p90_ms=float("nan")), ROW + r": p90_ms is nan; .*a finite number of milliseconds above 0"),
    ("infinite latency", row(p99_ms=float("inf")), ROW + r": p99_ms is inf; .*finite number of milliseconds"),
    ("zero latency", row(p50_ms=0), ROW + r": p50_ms is 0; .*above 0"),
    ("non-numeric latency", row(p50_ms="fast"), ROW + r": p50_ms is 'fast'; .*a finite number of milliseconds"),
    ("latency a boolean", row(p50_ms=True), ROW + r": p50_ms is True; .*a finite number of milliseconds"),
    ("latency missing", lambda res: res["bench"][0].pop("p50_ms"),
     ROW + r" has no p50_ms; .*a finite number of milliseconds above 0"),
    ("negative throughput", row(throughput_ips=-3.0), ROW + r": throughput_ips is -3.0; .*images per second"),
    ("batch zero", row(batch=0), r"bench\[0\] \(student onnx, batch 0\): batch is 0; .*a whole number from 1"),
    ("accuracy above 1", accuracy(score=1.5),
     r"accuracy\[0\] \(student onnx\): score is 1.5; .*a finite fraction from 0 to 1"),
    ("accuracy NaN", accuracy(score=float("nan")), r"accuracy\[0\] \(student onnx\): score is nan; .*from 0 to 1"),
    ("accuracy here negative", accuracy(here=-0.2), r"accuracy\[0\] \(student onnx\): here is -0.2; .*null or"),
    ("bench not a list", lambda res: res.update(bench={"student onnx": 1.0}),
     r"'bench' is an object; .*a list of rows, one per \(artifact, batch\)"),
    ("a row not an object", lambda res: res["bench"].insert(0, 3.5), r"bench\[0\] is 3.5; .*an object"),
    ("skipped without a reason", lambda res: res["skipped"].append({"artifact": "student onnx"}),
     r"skipped\[0\] \(student onnx\) has no reason"),
    ("written by an older run_bench.py", drop("kind", "artifacts"),
     r"written by an older run_bench.py.*toolchain bench BUILD_OUT --bundle DIR"),
    ("artifacts without a sha256", lambda res: res["artifacts"].update({"student onnx": "12"}),
     r"'artifacts': 'student onnx' has sha256 '12'; .*64 hex digits"),
]


@pytest.mark.parametrize("name,change,pattern", REPORT_CASES, ids=[c[0] for c in REPORT_CASES])
def test_bad_device_results_are_refused_and_nothing_is_merged(env, build_results, name, change, pattern):
    out = copy_build(env)
    before = {f: (out / f).read_bytes() for f in ("report.md", "build.json")}
    f = results_file(env, spoil(build_results, change))
    res = runner.invoke(app, ["report", str(out), "--device-results", str(f)])
    check_answer(res.exit_code, res.output, 2, r"--device-results '.*device_results_\d+\.json'.*" + pattern)
    assert {f: (out / f).read_bytes() for f in before} == before  # nothing merged, not even in part


def test_candidate_results_are_not_a_builds_device_results(env, candidate_results):
    out = copy_build(env)
    before = {f: (out / f).read_bytes() for f in ("report.md", "build.json")}
    res = runner.invoke(app, ["report", str(out), "--device-results", str(results_file(env, candidate_results))])
    check_answer(res.exit_code, res.output, 2, r"is the results of a candidates bundle, not of a build's bundle: "
                                               r"write one with `toolchain bench BUILD_OUT --bundle DIR`")
    assert {f: (out / f).read_bytes() for f in before} == before


def test_the_builds_own_results_still_merge(env, build_results):
    """The control for the cases above: the unspoiled results of this build's bundle merge."""
    out = copy_build(env)
    links = {f: (out / f).is_symlink() for f in ("report.md", "build.json")}
    res = runner.invoke(app, ["report", str(out), "--device-results", str(results_file(env, build_results)),
                              "--device-name", "bench-box"])
    assert res.exit_code == 0, res.output
    # an output folder that shows its current build through links keeps them: the merge lands in that build
    assert {f: (out / f).is_symlink() for f in links} == links
    assert "## On-device latency: bench-box" in (out / "report.md").read_text()
    assert json.loads((out / "build.json").read_text())["device_bench"]["bench-box"]["kind"] == "build"


# ---------------------------------------------------------------------------------------------------
# student.target: a candidates bundle's results, for `toolchain candidates` and before a build's first stage


def auto_recipe(env, target) -> str:
    return recipe(env, **{"student.name": "auto", "student.candidates": [CANDIDATE], "student.budget_ms": 1e6,
                          "student.target": str(target)})


def candidates_args(env, target) -> List[str]:
    return ["candidates", auto_recipe(env, target), "--store", str(folder(env, "store"))]


def candidate_build_args(env, target) -> List[str]:
    return build_args(env, auto_recipe(env, target))


TARGET_CASES: List[tuple] = [
    ("not JSON", lambda e, c, b: results_file(e, "{not json"), r"student.target '.*' is not valid JSON"),
    ("not results", lambda e, c, b: results_file(e, [1, 2]),
     r"student.target '.*' is not a results file written by a bundle's run_bench.py"),
    ("a build bundle's results", lambda e, c, b: results_file(e, b),
     r"student.target '.*' is the results of a build's bundle, not of a candidates bundle: write one with "
     r"`toolchain candidates RECIPE --bundle DIR`, run it on the device, and give its results.json"),
    ("a folder", lambda e, c, b: folder(e, "results_dir"),
     r"student.target '.*results_dir_\d+' is a folder; give the results.json"),
    ("negative latency", lambda e, c, b: results_file(e, spoil(c, row(p50_ms=-2.0))),
     r"student.target '.*': bench\[0\] \(timm:test_efficientnet onnx, batch 1\): p50_ms is -2.0; .*above 0"),
    ("NaN latency", lambda e, c, b: results_file(e, spoil(c, row(p90_ms=float("nan")))),
     r"student.target '.*': bench\[0\] .*: p90_ms is nan; .*a finite number of milliseconds"),
    ("non-numeric latency", lambda e, c, b: results_file(e, spoil(c, row(p50_ms="1,5"))),
     r"student.target '.*': bench\[0\] .*: p50_ms is '1,5'; .*a finite number of milliseconds"),
    ("image size a word", lambda e, c, b: results_file(e, spoil(c, row(image_size="big"))),
     r"student.target '.*': bench\[0\] .*: image_size is 'big'; .*one side in pixels or \[height, width\]"),
]


@pytest.mark.parametrize("command", ["candidates", "build"])
@pytest.mark.parametrize("name,make_target,pattern", TARGET_CASES, ids=[c[0] for c in TARGET_CASES])
def test_bad_student_target_results_are_refused_before_any_stage(env, candidate_results, build_results, command,
                                                                 name, make_target, pattern):
    target = make_target(env, candidate_results, build_results)
    argv = (candidates_args if command == "candidates" else candidate_build_args)(env, target)
    res = runner.invoke(app, argv)
    check_answer(res.exit_code, res.output, 2, pattern)
    if command == "build":  # refused by the recipe check: no stage ran, nothing recorded
        assert "data.prepare" not in res.output and not (Path(argv[-1]) / "build.json").exists()
        assert sealed(env.store) == env.sealed


def test_candidates_reads_a_devices_results_as_build_does(env, candidate_results):
    res = runner.invoke(app, candidates_args(env, results_file(env, candidate_results)), env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    timed = next(r for r in candidate_results["bench"] if r["model"] == CANDIDATE)
    assert CANDIDATE in res.output and f"{timed['p50_ms']:.2f}" in res.output and f"{timed['p90_ms']:.2f}" in res.output
