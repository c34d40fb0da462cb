"""Where the time goes (issue 67): each artifact's layer table as bench.latency writes it (bench/layer_report.py), read
for a person in report.md (MAC shares, the ten slowest layers, every layer that fell back and why, or why a runtime
cannot time layers), and the same tables from a device's results.json merged by ``toolchain report
--device-results``.  The real build with a bundle run on this machine is tests/test_bundle.py's."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vfm_toolchain.bench import layer_report
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.export.runtimes.layers import layer_row, layer_table


def _conv(i, ms, precision="int8", delegated=True, macs=100, note=None, kind="Convolution"):
    return layer_row(f"conv {i}", kind, "XNNPACK" if delegated else "tflite builtin", delegated, precision, ms, macs,
                     note=note)


def _hand_table():
    """Twelve int8 convolutions on the delegate, one float convolution the delegate did not take, and a float
    output layer (what tflite_int8's float_output keeps)."""
    rows = [_conv(i, float(i)) for i in range(1, 13)]
    rows.append(_conv(13, 20.0, "fp32", False, 300, note="the XNNPACK delegate did not take it"))
    rows.append(layer_row("FULLY_CONNECTED 14", "FULLY_CONNECTED", "XNNPACK", True, "fp32", 0.5, 100))
    return layer_table("litert", "xnnpack", 1, "XNNPACK", rows, 1, [150.0, 150.0])


def test_shares_slowest_and_fallbacks_of_a_hand_made_table():
    table = layer_report.annotate(_hand_table(), {"kind": "tflite_int8", "precision": "int8",
                                                  "float_ops": ["FULLY_CONNECTED"]})
    s = layer_report.summarize(table, model_macs=1600)
    # MACs: 12 x 100 int8 delegated, 300 float off the delegate, 100 float on it
    assert s["delegated_mac_share"] == pytest.approx(1300 / 1600) and s["int8_mac_share"] == pytest.approx(1200 / 1600)
    assert s["mac_note"] is None and s["layer_ms_sum"] == pytest.approx(sum(range(1, 13)) + 20.5)
    assert [r["name"] for r in s["slowest"]] == ["conv 13", *(f"conv {i}" for i in range(12, 3, -1))]
    why = {r["name"]: r["fell_back"] for r in s["fell_back"]}
    assert why == {"conv 13": "not on XNNPACK: the XNNPACK delegate did not take it",
                   "FULLY_CONNECTED 14": "the output layer is kept float (float_output)"}
    md = "\n".join(layer_report.section_lines([{"artifact": "student tflite_int8", "runtime": "litert",
                                                "summary": s}], "this machine", "layers/"))
    assert "| student tflite_int8 | litert (XNNPACK) | 81% | 75% | 98.50 of 150.00 ms (66%) | conv 13" in md
    assert "- not on XNNPACK: the XNNPACK delegate did not take it: 1 layer (20.00 ms): `conv 13`" in md
    assert "- the output layer is kept float (float_output): 1 layer (0.500 ms): `FULLY_CONNECTED 14`" in md
    # the layers cover two thirds of the call: the report says where the rest went
    assert "The layers account for 66% of the call: the other 51.50 ms" in md
    # an fp32 artifact's float layers are not fallbacks; a layer off the delegate still is
    fp32 = layer_report.summarize(layer_report.annotate(_hand_table(), {"kind": "tflite", "precision": "fp32"}))
    assert [r["name"] for r in fp32["fell_back"]] == ["conv 13"]


def test_openvino_layers_int8_slowed_or_the_accuracy_control_reverted_say_which():
    """An OpenVINO int8 IR's float convolutions, by the runtime's names (its own or those it fused): kept float for
    speed with the profile's times, reverted by NNCF's accuracy control, or neither."""
    rows = [layer_row("/ds/Conv", "Convolution", "CPU plugin", True, "fp32", 0.6, 100),
            layer_row("/head/Conv", "Convolution", "CPU plugin", True, "fp32", 0.2, 100, note="fused with /head/Relu"),
            layer_row("/other/Conv", "Convolution", "CPU plugin", True, "fp32", 0.1, 100),
            layer_row("/int8/Conv", "Convolution", "CPU plugin", True, "int8", 0.1, 100)]
    table = layer_table("openvino", "openvino CPU", 2, "CPU plugin", rows, 1, [1.0, 1.0])
    record = {"kind": "openvino_int8", "precision": "int8", "slow_layers_ms": {"/ds/Conv": (0.6, 0.84)},
              "layers_fp32": ["/ds/Conv"], "fallback": {"float_layers": ["/head/Relu"]}}
    why = {r["name"]: r["fell_back"] for r in layer_report.annotate(table, record)["rows"]}
    assert why == {"/ds/Conv": "int8 is slower here (layer profile: 0.600 ms fp32, 0.840 ms int8 on the build's CPU)",
                   "/head/Conv": "reverted to float by NNCF's accuracy control (the accuracy fallback)",
                   "/other/Conv": "the quantizer left it float; no export record names it", "/int8/Conv": None}


def test_a_runtime_that_cannot_time_layers_or_run_says_why():
    rows = [_conv(1, None), _conv(2, None, delegated=False, note="no kernel for it")]
    untimed = layer_table("litert", "xnnpack", 1, "XNNPACK", rows, 1, [3.0], why_untimed="no op profiler in Python")
    s = layer_report.summarize(layer_report.annotate(untimed, {"kind": "tflite", "precision": "fp32"}))
    assert not s["timed"] and s["slowest"] == [] and s["sum_over_total"] is None
    md = "\n".join(layer_report.section_lines(
        [{"artifact": "student tflite", "runtime": "litert", "summary": s},
         {"artifact": "student coreml", "runtime": "coreml", "reason": "not run here: Core ML prediction needs macOS"}],
        "this machine"))
    assert "| 50% | 100% | untimed: no op profiler in Python |" in md
    assert "| student coreml | coreml | | | no table: not run here: Core ML prediction needs macOS | | |" in md
    assert "- not on XNNPACK: no kernel for it: 1 layer: `conv 2`" in md


def test_a_delegate_whose_ops_have_no_macs_leaves_the_int8_share_unknown():
    """ExecuTorch's XNNPACK payload is opaque: only the portable kernels outside it have MACs."""
    rows = [_conv(1, 1.0, macs=None), _conv(2, 1.0, "fp32", False, 100, kind="aten::convolution")]
    s = layer_report.summarize(layer_table("executorch", "xnnpack", 1, "XnnpackBackend", rows, 1, [2.0]), 1000)
    assert s["delegated_mac_share"] == pytest.approx(0.9) and s["int8_mac_share"] is None
    assert "none inside its delegate" in s["mac_note"]


# ----------------------------------------------------------------------------------------------------------------
# a real artifact: an int8 ONNX file whose head the accuracy fallback kept in float, through the stage's own code


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.ReLU())
        self.conv = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, 1, 1), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.conv(self.stem(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def kept_head(tmp_path_factory):
    """``(fp32 file, int8 file, the int8 artifact's record)``: the int8 file quantized with the head's node left in
    fp32, and a record saying the accuracy fallback kept the module ``head`` float."""
    from vfm_toolchain.export.formats import export_format
    from vfm_toolchain.export.formats.onnx_quantized_format import quantize_qdq

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("kept_head")
    x = torch.randn(2, 3, 32, 32)
    calibration = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
    fp32 = export_format("onnx", Net().eval(), x, out / "onnx", None, calibration=calibration).path
    int8 = out / "model.int8.onnx"
    quantize_qdq(fp32, int8, calibration, exclude=["/head/Gemm"])
    record = {"model": "student", "kind": "onnx_int8", "status": "ok", "precision": "int8", "path": "model.int8.onnx",
              "bytes": int8.stat().st_size,
              "fallback": {"float_layers": ["head"], "ranked_layers": 3, "reason": "passed",
                           "steps": [{"test_score": 0.5}, {"test_score": 0.62}]}}
    return fp32, int8, record


def _ctx(workdir: Path):
    return SimpleNamespace(recipe=SimpleNamespace(bench=SimpleNamespace(threads=1, iters=10)), workdir=workdir,
                           log=logging.getLogger("test_layer_report"))


def test_a_layer_kept_float_is_named_in_the_report_with_its_reason(kept_head, tmp_path):
    from vfm_toolchain.bench.latency import BenchLatency, layer_table as stage_table
    from vfm_toolchain.stage import ReportContext, StageOutput

    _, int8, record = kept_head
    row = {"artifact": "student onnx_int8", "model": "student", "runtime": "onnxruntime", "batch": 1,
           "image_size": 32, "params": 1000, "macs": None, "bytes": record["bytes"], "p50_ms": 0.5, "p90_ms": 0.6,
           "p99_ms": 0.7, "mean_ms": 0.5, "throughput_ips": 2000.0, "provider": "CPUExecutionProvider"}
    entry = stage_table(_ctx(tmp_path), "onnxruntime", int8, record, "student onnx_int8", (32, 32), [row], None)
    table = json.loads((tmp_path / entry["file"]).read_text())
    head = [r for r in table["rows"] if r["name"] == "/head/Gemm"]
    assert head and head[0]["precision"] == "fp32" and "kept float by the accuracy fallback" in head[0]["fell_back"]
    assert row["layers"]["file"] == "layers/student_onnx_int8__onnxruntime.json" and row["layers"]["timed"]
    assert row["layers"]["int8_mac_share"] < 1.0 and row["layers"]["delegated_mac_share"] == 1.0
    # an artifact its runtime cannot profile: the reason, never the stage's failure
    lost = stage_table(_ctx(tmp_path), "onnxruntime", tmp_path / "gone.onnx", record, "student onnx", (32, 32), [],
                       None)
    assert lost["reason"].startswith("FileNotFoundError") and "file" not in lost

    out = StageOutput("bench.latency", "k", tmp_path, {"bench": [row], "unavailable": [], "layers": [entry, lost],
                                                       "machine": "this CPU (1 thread)"})
    build = ReportContext(None, {"export.convert": StageOutput("export.convert", "k", tmp_path,
                                                               {"artifacts": [record]})})
    section = BenchLatency().report(out, build)
    md = "\n".join(section.lines)
    assert md.index("## Where the time goes") > md.index("| student onnx_int8 | onnxruntime")
    assert "- kept float by the accuracy fallback (test 50.0% fully int8 -> 62.0% with 1 layers float): 1 layer" in md
    assert "`/head/Gemm`" in md and "| student onnx | onnxruntime | | | no table: FileNotFoundError" in md
    assert section.files == {entry["file"]: entry["file"]}
    assert section.record["bench"][0]["layers"] == row["layers"]  # build.json's bench row keeps the summary


def test_the_bundle_runner_writes_a_layer_table_or_the_reason(kept_head):
    from vfm_toolchain.bench import bundle_runner

    fp32, _, _ = kept_head
    art = {"label": "student onnx", "runtime": "onnxruntime", "file": str(fp32), "image_size": 32}
    got = bundle_runner.layer_table(art, 1, [{"batch": 1, "p50_ms": 400.0}])
    assert got["table"]["runs"] == 10 and got["table"]["rows"]  # a slow model gets fewer profiled calls
    json.dumps(got)  # as results.json holds it
    assert "reason" in bundle_runner.layer_table({**art, "file": "/nonexistent.onnx"}, 1, [])
    assert "has no layers()" in bundle_runner.layer_table({**art, "runtime": "pytorch"}, 1, [])["reason"]


# ----------------------------------------------------------------------------------------------------------------
# a device's tables, merged


def _device_build(tmp_path, kept_head):
    fp32, int8, record = kept_head
    build_dir = tmp_path / "o"
    build_dir.mkdir()
    (build_dir / "model.int8.onnx").write_bytes(int8.read_bytes())
    arts = [{**record, "sha256": "a" * 64},
            {"model": "student", "kind": "tflite", "status": "ok", "sha256": "b" * 64, "path": "model.tflite"}]
    (build_dir / "build.json").write_text(json.dumps({"name": "tiny", "artifacts": arts, "bench": []}))
    (build_dir / "report.md").write_text("# Build report: tiny\n\n## Stages\n")
    table = layer_table("onnxruntime", "CPUExecutionProvider", 4, "CPUExecutionProvider",
                        [layer_row("/head/Gemm", "Gemm", "CPUExecutionProvider", True, "fp32", 0.2, 320),
                         layer_row("/conv/conv.0/Conv_token_3", "QLinearConv", "CPUExecutionProvider", True, "int8",
                                   1.0, 9000)], 1, [1.25])
    bench = {"model": "student", "runtime": "onnxruntime", "batch": 1, "image_size": 32, "p50_ms": 1.3,
             "p90_ms": 1.4, "p99_ms": 1.5, "throughput_ips": 700.0}
    res = {"bundle": "tiny", "kind": "build", "artifacts": {"student onnx_int8": "a" * 64, "student tflite": "b" * 64},
           "device": {"machine": "aarch64", "system": "Linux", "processor": "", "python": "3.11"},
           "measured_at": "now", "bench": [{"artifact": "student onnx_int8", **bench}], "skipped": [],
           "layers": [{"artifact": "student onnx_int8", "runtime": "onnxruntime", "table": table},
                      {"artifact": "student tflite", "runtime": "litert",
                       "reason": "ImportError: no module named ai_edge_litert"}]}
    return build_dir, res


def test_device_layer_tables_land_in_the_report(kept_head, tmp_path):
    from vfm_toolchain.bench.bundle import merge_device_results

    build_dir, res = _device_build(tmp_path, kept_head)
    f = tmp_path / "results.json"
    f.write_text(json.dumps(res))
    merge_device_results(build_dir, f, "pi5")
    merge_device_results(build_dir, f, "pi5")  # a re-merge replaces
    report = (build_dir / "report.md").read_text()
    assert report.count("### Where the time goes on pi5") == 1
    section = report[report.index("### Where the time goes on pi5"):]
    assert "| student onnx_int8 | onnxruntime (CPUExecutionProvider) | 100% | 97% | 1.20 of 1.25 ms (96%) |" in section
    assert "kept float by the accuracy fallback" in section and "`/head/Gemm`" in section
    assert "no table: ImportError: no module named ai_edge_litert" in section
    stored = json.loads((build_dir / "build.json").read_text())["device_bench"]["pi5"]["layers"]
    assert stored[0]["table"]["rows"][0]["fell_back"].startswith("kept float")


@pytest.mark.parametrize("change, pattern", [
    (lambda t: t["rows"][0].update(ms=-1.0), r"layers\[0\] \(student onnx_int8\): table is"),
    (lambda t: t.pop("rows"), r"layers\[0\] \(student onnx_int8\): table is"),
])
def test_a_bad_device_layer_table_is_refused(kept_head, tmp_path, change, pattern):
    from vfm_toolchain.bench.bundle import merge_device_results

    build_dir, res = _device_build(tmp_path, kept_head)
    change(res["layers"][0]["table"])
    f = tmp_path / "results.json"
    f.write_text(json.dumps(res))
    with pytest.raises(ToolchainError, match=pattern):
        merge_device_results(build_dir, f, "pi5")
    assert "pi5" not in (build_dir / "report.md").read_text()
    res["layers"] = [{"artifact": "student tflite", "runtime": "litert"}]
    f.write_text(json.dumps(res))
    with pytest.raises(ToolchainError, match="neither a table nor a reason"):
        merge_device_results(build_dir, f, "pi5")


def test_the_first_screen_says_how_much_of_the_shipped_artifact_is_delegated_and_int8():
    from vfm_toolchain.bench.report import first_screen
    from vfm_toolchain.stage import Score

    art = {"model": "student", "kind": "onnx_int8", "status": "ok", "path": "artifacts/student/model.int8.onnx",
           "bytes": 1_200_000, "precision": "int8"}
    row = {"artifact": "student onnx_int8", "model": "student", "runtime": "onnxruntime", "batch": 1, "p50_ms": 3.0,
           "provider": "CPUExecutionProvider",
           "layers": layer_report.compact({"timed": True, "delegated_mac_share": 1.0, "int8_mac_share": 0.93}, "f")}
    scores = [Score("student_top1", "student", 0.4, model="student", plot="student")]
    recipe = SimpleNamespace(name="tiny", target="cpu", data=SimpleNamespace(task="classification"),
                             export=SimpleNamespace(max_accuracy_drop=0.02))
    lines = first_screen(recipe, [art], [row], scores, "this CPU")
    assert "- Layers: 100% of the MACs delegated, 93% in int8 (see Where the time goes)" in lines
    lines = first_screen(SimpleNamespace(**{**vars(recipe), "target": None}), [art], [row], scores, "this CPU")
    assert "Share of the MACs delegated / in int8 (see Where the time goes): cpu 100% / 93%; x86 100% / 93%." in lines
