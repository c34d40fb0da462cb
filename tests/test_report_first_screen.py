"""The report's first screen (issue 66): the artifact to ship for the recipe's target, how accurate, fast and large
it is, and every artifact left out and why, before any table of stages.  Built from hand-made build records."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import tiny_recipe
from vfm_toolchain.plugins import load_plugins
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.stage import ReportSection, Score

load_plugins()

MACHINE = "AMD EPYC 7B13 (2 threads)"
SCORES = [Score("student_distilled_top1", "student, distilled + finetuned", 0.42, model="student", plot="distilled"),
          Score("student_baseline_top1", "student, labels only", 0.30, model="student", exported=False)]


def _recipe(target, task="classification"):
    return SimpleNamespace(name="tiny", target=target, data=SimpleNamespace(task=task),
                           export=SimpleNamespace(max_accuracy_drop=0.02))


def _art(kind, file, mb, **kw):
    return {"model": "student", "kind": kind, "status": "ok", "path": f"artifacts/student/{file}",
            "bytes": int(mb * 1e6), **kw}


def _row(kind, runtime, ms, provider, batch=1, **kw):
    return {"artifact": f"student {kind}", "model": "student", "runtime": runtime, "batch": batch, "p50_ms": ms,
            "provider": provider, **kw}


def _int8(score=0.41, **kw):
    return _art("onnx_int8", "model.int8.onnx", 1.2, precision="int8", metric="top1", test_score=score,
                fp32_test_score=0.42, accuracy_drop=0.42 - score, **kw)


ARTIFACTS = [_art("onnx", "model.onnx", 4.5, opset_written=17), _int8(),
             _art("openvino", "model.xml", 4.6), _art("tflite", "model.tflite", 4.4)]
BENCH = [_row("onnx", "onnxruntime", 4.0, "CPUExecutionProvider"), _row("onnx_int8", "onnxruntime", 3.1,
                                                                        "CPUExecutionProvider"),
         _row("openvino", "openvino", 3.5, "openvino CPU"), _row("tflite", "litert", 5.0, "xnnpack (2 threads)"),
         _row("onnx", "onnxruntime", 20.0, "CPUExecutionProvider", batch=8)]


def _screen(target, artifacts=ARTIFACTS, bench=BENCH, task="classification", scores=SCORES):
    from vfm_toolchain.bench.report import first_screen

    return first_screen(_recipe(target, task), artifacts, bench, scores, MACHINE)


def _left_out(lines):
    """The "Left out" entries by artifact: what each was left out for."""
    start = next(i for i, line in enumerate(lines) if "Left out:" in line)
    return dict(line.strip()[2:].split(": ", 1) for line in lines[start + 1:] if line.strip().startswith("- "))


def test_a_target_ships_its_fastest_timed_artifact_and_says_why_each_other_was_left_out():
    lines = _screen("x86")
    text = "\n".join(lines)
    assert lines[0] == "## Ship this" and len(lines) <= 16
    assert "For **x86** (the recipe's `target`), ship `artifacts/student/model.int8.onnx` (student onnx_int8, int8)." \
        in text
    assert "- Accuracy: 41.0% test top-1, measured through this artifact (fp32: 42.0%)" in lines
    assert (f"- Latency: 3.10 ms p50 at batch 1 on onnxruntime / CPUExecutionProvider, measured here on {MACHINE}"
            in lines)
    assert "- Size: 1.20 MB on disk" in lines
    left = _left_out(lines)
    assert left == {"student onnx": "slower: 4.00 ms p50 on onnxruntime / CPUExecutionProvider against 3.10 ms",
                    "student openvino": "slower: 3.50 ms p50 on openvino / openvino CPU against 3.10 ms",
                    "student tflite": "made for android, not x86"}


def test_the_pick_says_its_speed_up_over_fp32_onnx_timed_side_by_side():
    """The bench's side-by-side pass gives each batch-1 row a median timed in turn with the others: the pick's
    ratio to the fp32 ONNX artifact comes from there, not from two rows timed minutes apart."""
    paired = [dict(r, side_by_side_ms=2.0, side_by_side_speedup=2.2) if r["artifact"] == "student onnx_int8" and
              r["batch"] == 1 and r["runtime"] == "onnxruntime" else r for r in BENCH]
    latency = next(line for line in _screen("x86", bench=paired) if line.startswith("- Latency:"))
    assert latency.endswith("; 2.20x the speed of the fp32 `onnx` artifact on ONNX Runtime, timed side by side")
    assert "side by side" not in "\n".join(_screen("x86"))  # no pass, no ratio
    cells = "\n".join(_screen(None, bench=paired))
    assert "(2.20x ONNX Runtime fp32 side by side)" in cells


def test_a_pick_timed_only_unsteadily_says_so_rather_than_untimed():
    bench = [dict(r, unstable="cv 0.4 > 0.3") for r in BENCH if r["artifact"] == "student onnx"]
    lines = _screen("cpu", artifacts=ARTIFACTS[:1], bench=bench)
    latency = next(line for line in lines if line.startswith("- Latency:"))
    assert "timed here but unstable (cv 0.4 > 0.3; 4.00 ms p50 is no measurement): rerun on an idle machine" in latency
    assert "not timed here" not in latency


def test_an_unstable_row_is_no_measurement_so_the_next_fastest_ships():
    bench = [dict(r, unstable="cv 0.4 > 0.1") if r["artifact"] == "student onnx_int8" else r for r in BENCH]
    lines = _screen("x86", bench=bench)
    assert any("ship `artifacts/student/model.xml` (student openvino, fp32)" in line for line in lines)
    # an fp32 artifact's accuracy is its PyTorch model's, which it matched at parity: the screen says whose
    assert ("- Accuracy: 42.0% test top-1, the PyTorch student's (student, distilled + finetuned); this artifact "
            "matched it at parity") in lines
    assert _left_out(lines)["student onnx_int8"] == "its timing here was unstable (cv 0.4 > 0.1), so not compared"


@pytest.mark.parametrize("status", ["ok", "failed"])
def test_an_artifact_that_failed_its_accuracy_gate_is_left_out_with_its_numbers(status):
    artifacts = [ARTIFACTS[0], _int8(score=0.37, status=status)]  # the int8 row is the fastest: 3.10 ms
    lines = _screen("cpu", artifacts=artifacts)
    assert any("ship `artifacts/student/model.onnx` (student onnx, fp32)" in line for line in lines)
    assert any("4.00 ms p50 at batch 1 on onnxruntime" in line for line in lines)
    gate = ("failed its accuracy gate: test top-1 37.0% against fp32 42.0%, 5.0 points down "
            "(export.max_accuracy_drop allows 2.0)")
    assert _left_out(lines) == {"student onnx_int8": gate}
    assert _left_out(_screen(None, artifacts=artifacts))["student onnx_int8"] == gate


def test_without_a_target_one_line_per_target_an_exported_artifact_serves():
    artifacts = [*ARTIFACTS, {"model": "student", "kind": "tensorrt", "status": "skipped",
                              "reason": "needs TensorRT and an NVIDIA GPU"}]
    lines = _screen(None, artifacts=artifacts)
    assert lines[0] == "## Ship this" and "No `target` in the recipe" in lines[2]
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ") and " | ship | " not in line}
    assert list(rows) == ["cpu", "x86", "android", "nvidia"]  # in TARGETS order; nothing here serves ios
    assert "`artifacts/student/model.int8.onnx` (student onnx_int8, int8)" in rows["cpu"]
    assert "`artifacts/student/model.int8.onnx`" in rows["x86"] and "3.10 ms p50" in rows["x86"]
    assert "`artifacts/student/model.tflite`" in rows["android"] and "indicative only" in rows["android"]
    assert "| 42.0%, the PyTorch student's; matched at parity |" in rows["android"]
    assert f"Measured here on {MACHINE}, steady p50 at batch 1." in lines  # once, under the table
    # a CPU row says nothing about a GPU: the onnx file is named for nvidia, untimed, and how to time it is said
    assert "`artifacts/student/model.onnx` (student onnx, fp32)" in rows["nvidia"]
    assert ("not timed here: no TensorRT engine or CUDA ONNX Runtime timed here; time it on the device with "
            "`toolchain bench --bundle`") in rows["nvidia"]
    assert _left_out(lines) == {
        "student openvino": "for x86: slower: 3.50 ms p50 on openvino / openvino CPU against 3.10 ms",
        "student tensorrt": "not made here: needs TensorRT and an NVIDIA GPU"}


def test_a_target_nothing_was_timed_for_says_why_and_how_to_time_it():
    artifacts = [*ARTIFACTS, _art("coreml", "model.mlpackage", 4.3, precision="fp16", parity_skipped="needs macOS")]
    lines = _screen("ios", artifacts=artifacts)
    assert any("ship `artifacts/student/model.mlpackage` (student coreml, fp16)" in line for line in lines)
    assert ("- Latency: not timed here: Core ML runs on macOS / iOS only; time it on the device with "
            "`toolchain bench --bundle`") in lines
    assert ("- Accuracy: 42.0% test top-1, the PyTorch student's (student, distilled + finetuned); parity not "
            "checked here: needs macOS") in lines
    assert _left_out(lines)["student onnx"] == "made for cpu, x86, nvidia, not ios"


def test_a_target_nothing_exported_serves_says_which_formats_would():
    lines = _screen("android", artifacts=ARTIFACTS[:2])
    assert any("nothing this build exported can ship: add one of executorch, executorch_int8, ncnn, ncnn_fp16, "
               "tflite, tflite_fp16, tflite_int8 to `export.formats`" in line for line in lines)
    assert set(_left_out(lines)) == {"student onnx", "student onnx_int8"}
    assert _screen(None, artifacts=[], bench=[]) == []  # nothing exported, nothing asked: no first screen


def test_a_detector_ships_at_its_own_measured_map50():
    onnx = _art("onnx", "model.onnx", 9.0, metric="map50", test_score=0.512, test_map50=0.512,
                pytorch_test_map50=0.514, parity="detections")
    lines = _screen("cpu", artifacts=[onnx], bench=[BENCH[0]], task="detection")
    assert "- Accuracy: 51.2% test mAP50, measured through this artifact (PyTorch: 51.4%)" in lines


def test_the_first_screen_comes_right_after_the_title_and_before_any_stage_table():
    from vfm_toolchain.bench.report import recommendations, report_markdown

    sections = {"bench": ReportSection(title="Latency", lines=["| artifact | runtime |"], scores=SCORES)}
    history = [{"name": "bench.latency", "status": "ran", "seconds": 1.0}]
    md = report_markdown(_recipe("x86"), sections, history, recommendations(BENCH, ARTIFACTS), [], False,
                         screen=_screen("x86"))
    assert md.startswith("# Build report: tiny\n\n## Ship this\n\nFor **x86**")
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles[0] == "## Ship this" and titles[-2:] == ["## Stages", "## Warnings"]
    assert md.index("## Ship this") < md.index("## Accuracy") < md.index("## Latency") < md.index("## Stages")


def test_the_report_is_rebuilt_when_the_target_changes(tiny_task):
    from vfm_toolchain.bench.report import Report

    keys = {t: Report().config(recipe_from_dict(tiny_recipe(tiny_task, target=t))) for t in (None, "x86", "ios")}
    assert len(set(map(str, keys.values()))) == 3
