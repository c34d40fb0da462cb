"""Device bundles: the runner needs only numpy + the runtime, measures the bundle's own artifacts, and
its results merge into the build report."""
import ast
import json
import platform
import shutil
import subprocess
import sys

import pytest

from vfm_toolchain.bench.bundle import merge_device_results, write_bundle
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build

from conftest import tiny_recipe


# Core ML predicts on macOS alone: there its rows are measured, elsewhere they are reported with the reason
ON_MACOS = platform.system() == "Darwin"


def test_bundle_runs_on_this_machine_and_merges_into_the_report(hostile_env, tmp_path):
    """Also: rows carry MACs and peak memory, runtimes this machine lacks are reported with the reason,
    and ONNX external data travels with its model into the bundle.  Starts from a copy of the shared finished
    build's store: only export and bench run."""
    shutil.copytree(hostile_env.store, tmp_path / "s")
    raw = tiny_recipe(hostile_env.task, **{"export.formats": ["onnx", "onnx_int8", "coreml"], "export.calibration_images": 8,
                                    # one int8 candidate: the layouts' race is test_edge_formats.py's
                                    "export.options": {"onnx": {"external_data_mb": 0},
                                                       "onnx_int8": {"layout": "qdq", "fp32_slow_layers": False}},
                                    "export.max_accuracy_drop": 1.0,
                                    # no pytorch rows: the bundle carries exported files alone (a PyTorch
                                    # model's memory probe is test_detection_export.py's)
                                    "bench.runtimes": ["onnxruntime", "onnxruntime_cuda", "coreml"],
                                    "bench.memory": True})
    build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s")
    record = json.loads((tmp_path / "o" / "build.json").read_text())
    assert record["bench"] and all(r["macs"] > 0 and r["peak_memory_bytes"] > 0 for r in record["bench"])
    report = (tmp_path / "o" / "report.md").read_text()
    assert "not measured: student onnx on onnxruntime_cuda" in report
    assert ("not measured: student coreml on coreml (Core ML prediction needs macOS)" in report) != ON_MACOS
    # where the time goes (issue 67): each artifact timed here has its layer table, in build.json's batch-1 row, in
    # layers/ beside the report, and in the report, its layers' time within a fifth of the call or the report says why
    tables = {r["artifact"]: r["layers"] for r in record["bench"] if r["runtime"] == "onnxruntime" and r["batch"] == 1}
    assert set(tables) == {"student onnx", "student onnx_int8"}
    assert all(t["timed"] and t["delegated_mac_share"] == 1.0 and (tmp_path / "o" / t["file"]).is_file()
               for t in tables.values())
    assert tables["student onnx"]["int8_mac_share"] == 0.0 and tables["student onnx_int8"]["int8_mac_share"] > 0.5
    where = report[report.index("## Where the time goes"):]
    assert report.index("## Latency") < report.index("## Where the time goes") < report.index("## Stages")
    assert ("The layers account for" in where) or all(0.8 <= t["sum_over_total"] <= 1.2 for t in tables.values())
    assert ("| student coreml | coreml | | | no table: not run here: Core ML" in where) != ON_MACOS
    bundle = write_bundle(tmp_path / "o", tmp_path / "bundle")
    files = {p.name for p in bundle.iterdir()}
    assert {"run_bench.py", "runtimes", "bundle.json", "README.md", "student_onnx", "student_coreml.mlpackage",
            "student_onnx_int8.int8.onnx", "test_student.npz"} <= files
    assert {p.name for p in (bundle / "student_onnx").iterdir()} == {"model.onnx", "model.onnx.data"}
    # the device scores and times with the build's own runtime files, byte for byte
    from vfm_toolchain.export.runtimes import runtime_files

    layer = runtime_files()
    assert {f.name for f in layer} >= {"base.py", "measure.py", "onnxruntime_runtime.py", "coreml_runtime.py"}
    assert {p.name for p in (bundle / "runtimes").iterdir()} == {f.name for f in layer} | {"__init__.py"}
    assert all((bundle / "runtimes" / f.name).read_bytes() == f.read_bytes() for f in layer)
    imported = set()
    for f in [bundle / "run_bench.py", *(bundle / "runtimes").glob("*.py")]:
        tree = ast.parse(f.read_text())
        for branch in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "__package__"]:
            branch.body = []  # imported as vfm_toolchain.bench.bundle_runner, in the toolchain: not on the device
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    runtimes = {"onnxruntime", "coremltools", "PIL", "executorch", "torch", "ai_edge_litert", "openvino", "tensorrt",
                "openvino_telemetry", "ncnn", "onnx"}  # onnx: only where installed (layer tables' MACs of int8 nodes)
    assert imported <= {"__future__", "argparse", "functools", "heapq", "importlib", "json", "os", "platform",
                        "subprocess", "sys", "threading", "time", "pathlib", "typing", "unittest", "contextlib", "re", "tempfile",
                        "numpy", "runtimes", "psutil"} | runtimes  # no toolchain
    out = subprocess.run([sys.executable, "run_bench.py", "--iters", "3", "--warmup", "1"], cwd=bundle,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((bundle / "results.json").read_text())
    labels = {(r["artifact"], r["batch"]) for r in res["bench"]}
    onnx_rows = {("student onnx", 1), ("student onnx", 2), ("student onnx_int8", 1), ("student onnx_int8", 2)}
    assert labels >= onnx_rows
    assert {a for a, _ in labels - onnx_rows} == ({"student coreml"} if ON_MACOS else set())
    assert all(r["p50_ms"] > 0 and r["iters"] == 3 and r["macs"] > 0 and r["peak_memory_bytes"] > 0
               for r in res["bench"])
    assert [s["artifact"] for s in res["skipped"]] == ([] if ON_MACOS else ["student coreml"])
    # accuracy where it runs: the slice scored on the "device" is scored identically here, and the fp32 artifact
    # matches the build's own test top-1 (the whole tiny test split travelled, at the student's input size)
    assert {(x["artifact"], "table" in x) for x in res["layers"]} == \
        {("student onnx", True), ("student onnx_int8", True)} | ({("student coreml", True)} if ON_MACOS else set())
    acc = {a["artifact"]: a for a in res["accuracy"]}
    assert set(acc) == {"student onnx", "student onnx_int8"} | ({"student coreml"} if ON_MACOS else set())
    assert all(a["images"] == 12 and a["metric"] == "top1" and a["score"] == a["here"] for a in acc.values())
    assert acc["student onnx"]["score"] == pytest.approx(acc["student onnx"]["build_test_score"])
    assert acc["student onnx_int8"]["build_test_score"] is not None
    merge_device_results(tmp_path / "o", bundle / "results.json", "this-machine")
    merge_device_results(tmp_path / "o", bundle / "results.json", "this-machine")  # a re-merge replaces
    report = (tmp_path / "o" / "report.md").read_text()
    assert report.count("## On-device latency: this-machine") == 1 and "student onnx_int8" in report
    assert report.count("Accuracy on the bundle's labeled test slice") == 1
    assert report.count("### Where the time goes on this-machine") == 1
    assert "this-machine" in json.loads((tmp_path / "o" / "build.json").read_text())["device_bench"]


def test_bundle_of_something_that_is_not_a_build(tmp_path):
    with pytest.raises(ToolchainError, match="not a build output"):
        write_bundle(tmp_path, tmp_path / "b")


def test_pareto_front_keeps_only_undominated_choices():
    from vfm_toolchain.bench.report import pareto_front
    from vfm_toolchain.stage import Point

    pts = [Point("a", 1, 0.5), Point("b", 2, 0.4), Point("c", 3, 0.7), Point("d", 0.5, 0.3), Point("e", 3, 0.6)]
    assert [(p.latency_ms, p.score) for p in pareto_front(pts)] == [(0.5, 0.3), (1, 0.5), (3, 0.7)]


def test_precision_changes_pair_accuracy_with_latency():
    from vfm_toolchain.bench.latency import precision_changes

    bench = [{"artifact": "student onnx", "runtime": "onnxruntime", "batch": 1, "p50_ms": 2.0},
             {"artifact": "student onnx_int8", "runtime": "onnxruntime", "batch": 1, "p50_ms": 1.0},
             {"artifact": "student onnx_int8", "runtime": "onnxruntime", "batch": 8, "p50_ms": 5.0}]
    arts = [{"model": "student", "kind": "onnx"},
            {"model": "student", "kind": "onnx_int8", "metric": "top1", "test_score": 0.9, "accuracy_drop": 0.01}]
    assert precision_changes(bench, arts) == [
        "- student onnx_int8: test top-1 90.0% (-1.0 points against fp32), p50 1.00 ms against 2.00 ms fp32 on "
        "onnxruntime (0.50x)"]
    for row, ms in zip(bench[:2], (2.2, 0.9)):  # with the bench's side-by-side pass, its ratio too
        row["side_by_side_ms"] = ms
    assert precision_changes(bench, arts)[0].endswith("on onnxruntime (0.50x; side by side 0.41x)")


def test_scoring_here_uses_the_package_and_leaves_the_import_path_alone():
    """The toolchain imports the runner to score a slice here: the runtime layer's own modules, no sys.path entry."""
    import importlib
    import sys

    import vfm_toolchain.bench.bundle_runner as runner
    before = list(sys.path)
    importlib.reload(runner)
    assert sys.path == before and runner.measure_stable.__module__ == "vfm_toolchain.export.runtimes.measure"
