"""Every export format and runtime in the registries, table-driven: a tiny student is exported to each format whose
modules are installed, checked through the runtime that declares it runs that format (fp32 by parity, reduced
precision by agreement with fp32), and timed through the same runtime the bench uses.  A new format or runtime joins
these tests by registering, with nothing to add here."""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

from vfm_toolchain.export.formats import FORMATS, Skipped, export_format
from vfm_toolchain.export.formats.base import missing_modules
from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable
from vfm_toolchain.export.runtimes.measure import measure_latency
from vfm_toolchain.students.fold import fold_model

SIZE = 32
# run by `make test` in a pytest process of their own (Makefile): the converters load LLVM (LiteRT), JAX, TBB
# (OpenVINO) and XNNPACK into the process, and the whole suite in one process died with SIGSEGV (SI_KERNEL, while
# the main thread waited on a later test's subprocess); every test here and everything else pass apart
pytestmark = pytest.mark.edge


@pytest.fixture(scope="module")
def tiny_student():
    """A FastViT with one block per stage: reparameterizable branches, BatchNorm and an ONNX-safe graph, 0.2M params."""
    torch.manual_seed(0)
    model = timm.create_model("fastvit_t8", layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_classes=3).eval()
    for m in model.modules():  # trained-looking BatchNorm statistics, so folding has something to fold
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(4, 3, SIZE, SIZE)
    folded, _ = fold_model(model, {"family": "student"}, x)
    return folded, x


@pytest.fixture(scope="module")
def exported(tiny_student, tmp_path_factory):
    """Artifacts by format, made once for the module."""
    folded, x = tiny_student
    out, made = tmp_path_factory.mktemp("formats"), {}
    calibration = np.random.default_rng(0).standard_normal((16, 3, SIZE, SIZE)).astype(np.float32)

    def make(fmt):
        if fmt not in made:  # export_format makes the fp32 ONNX a format is built from when none is given
            made[fmt] = export_format(fmt, folded, x, out / fmt, calibration=calibration,
                                      onnx=made["onnx"].path if "onnx" in made else None)
        return made[fmt]
    return make


def _present(fmt: str) -> None:
    missing = missing_modules(fmt)
    if missing:
        pytest.skip(f"{fmt} needs {', '.join(missing)}: {FORMATS.meta(fmt)['install']}")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_exports_a_tiny_student_that_its_runtime_checks_and_times(fmt, tiny_student, exported):
    _present(fmt)
    folded, x = tiny_student
    meta = FORMATS.meta(fmt)
    try:
        res = exported(fmt)
    except Skipped as why:  # TensorRT without a GPU: the reason is the format's own
        pytest.skip(f"{fmt}: {why}")
    assert res.path.exists() and res.meta.get("precision", meta["precision"]) in ("fp32", "fp16", "int8")
    with torch.no_grad():
        ref = folded(x).numpy()
    if res.runner is None:  # converted but not runnable here (Core ML off macOS) says why
        assert res.parity_skipped
        pytest.skip(f"{fmt} converted; {res.parity_skipped}")
    out = np.asarray(res.runner(x.numpy()))
    assert out.shape == ref.shape
    if res.meta.get("precision", meta["precision"]) == "fp32":
        assert np.abs(out - ref).max() < 1e-4
    else:  # fp16 / int8: close to fp32 on a tiny well-scaled model, and not a copy of it (onnx_int8's layout is
        # chosen by its speed on the machine, and one layout's error reached 0.053 of the bound's scale)
        assert 0 < np.abs(out - ref).max() < 0.08 * (np.abs(ref).max() + 1)
    # timed through every runtime that declares it runs this format's family, as bench.latency does
    runtimes = [name for name in RUNTIMES if RUNTIMES.meta(name)["runs"] == meta["runtime"]]
    assert runtimes, f"no runtime runs {fmt}'s family {meta['runtime']!r}"
    timed = 0
    for name in runtimes:
        try:
            run = RUNTIMES.get(name)(res.path, threads=1)
        except Unavailable:
            continue  # a pinned provider this machine lacks (CUDA, TensorRT)
        stats = measure_latency(run, x[:1].numpy(), warmup=1, iters=3)
        assert stats["p50_ms"] > 0
        np.testing.assert_allclose(run(x[:2].numpy()), out[:2], rtol=1e-4, atol=1e-4)  # the same numbers
        timed += 1
    assert timed, f"no runtime could run {fmt} here"
    if meta["bundle"]:  # the device bundle's runner loads it with its family's default runtime: the same numbers
        from vfm_toolchain.bench.bundle_runner import loaders

        np.testing.assert_allclose(loaders()[meta["runtime"]](res.path, 1)(x[:2].numpy()), out[:2], rtol=1e-4,
                                   atol=1e-4)


def test_every_runtime_family_has_a_format_and_a_device_loader():
    from vfm_toolchain.bench.bundle_runner import loaders

    LOADERS = loaders()
    families = {RUNTIMES.meta(name)["runs"] for name in RUNTIMES} - {None}
    declared = {FORMATS.meta(fmt)["runtime"] for fmt in FORMATS}
    assert families <= declared
    bundled = {FORMATS.meta(fmt)["runtime"] for fmt in FORMATS if FORMATS.meta(fmt)["bundle"]}
    assert bundled <= set(LOADERS), f"bundled formats whose family run_bench.py cannot load: {bundled - set(LOADERS)}"


def test_mobilevit_v2_converts_to_litert_after_the_broadcast_fold(tmp_path):
    """LiteRT's converter rejects timm's ``context.expand_as(value)`` product; the broadcast_attention fold pass
    rewrites it to the same numbers in a form it takes."""
    _present("tflite")
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", num_classes=3).eval()
    x = torch.randn(2, 3, 64, 64)
    with pytest.raises(Exception, match="broadcast-compatible"):
        export_format("tflite", model, x, tmp_path / "raw")
    folded, records = fold_model(model, {"family": "student"}, x)
    assert next(r for r in records if r["pass"] == "broadcast_attention")["max_abs_diff"] < 1e-5
    res = export_format("tflite", folded, x, tmp_path / "folded")
    with torch.no_grad():
        assert np.abs(res.runner(x.numpy()) - folded(x).numpy()).max() < 1e-4


def test_executorch_partitioners_that_cannot_run_here_are_converted_and_say_so(tiny_student, tmp_path, monkeypatch):
    _present("executorch")
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)  # the refusal without Qualcomm's SDK, wherever this runs
    folded, x = tiny_student
    with pytest.raises(Skipped, match="QNN_SDK_ROOT"):
        export_format("executorch", folded, x, tmp_path / "qnn", {"partitioners": ["qnn", "xnnpack"]})
    with pytest.raises(Exception, match="partitioners"):
        export_format("executorch", folded, x, tmp_path / "bad", {"partitioners": ["nnapi"]})


def test_a_recipe_naming_a_format_whose_modules_are_missing_fails_before_any_stage(tiny_task, tmp_path, monkeypatch):
    import importlib.util

    from tests.conftest import tiny_recipe
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(ToolchainError, match=r"'openvino', which needs openvino.*vfm-toolchain\[edge\]"):
        build(recipe_from_dict(tiny_recipe(tiny_task, **{"export.formats": ["onnx", "openvino"]})),
              tmp_path / "o", tmp_path / "s")
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_onnx_int8_layout_is_chosen_by_timing_both_and_recorded(tiny_student, tmp_path):
    import onnx

    _present("onnx_int8")
    folded, x = tiny_student
    src = export_format("onnx", folded, x, tmp_path / "fp32", {"opset": 17})
    calib = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)
    ops = {}
    for layout in ("qdq", "qoperator"):
        res = export_format("onnx_int8", folded, x, tmp_path / layout, {"layout": layout, "fp32_slow_layers": False},
                            onnx=src.path, calibration=calib)
        ops[layout] = {n.op_type for n in onnx.load(str(res.path)).graph.node}
    assert "QLinearConv" in ops["qoperator"] and "QLinearConv" not in ops["qdq"] and "DequantizeLinear" in ops["qdq"]
    auto = export_format("onnx_int8", folded, x, tmp_path / "auto", {"fp32_slow_layers": False}, onnx=src.path,
                         calibration=calib)
    times = auto.meta["layout_p50_ms"]
    assert set(times) == {"qdq", "qoperator"} and auto.meta["layout"] == min(times, key=times.get)
    chosen = {n.op_type for n in onnx.load(str(auto.path)).graph.node}
    assert chosen == ops[auto.meta["layout"]] and auto.meta["layout"] in auto.meta["layout_reason"]
    assert sorted(p.name for p in (tmp_path / "auto").iterdir()) == ["model.int8.onnx"]  # candidates cleaned up


def test_onnx_int8_auto_layout_keeps_the_faster_layout_only_if_it_passes_the_accuracy_gate(tiny_student, tmp_path):
    """The build's gate judges the layouts fastest first: a faster layout that loses too much gives way to the slower
    one, and the record says why."""
    import onnx

    _present("onnx_int8")
    folded, x = tiny_student
    src = export_format("onnx", folded, x, tmp_path / "fp32", {"opset": 17})
    calib = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)
    calls = []

    def judge(runner):  # fails the first layout it is shown (the faster), passes the next
        calls.append(np.asarray(runner(x.numpy())).shape)  # handed a working runner of that candidate
        ok = len(calls) > 1
        return {"test_score": 0.9 if ok else 0.5, "fp32_test_score": 0.9, "accuracy_drop": 0.0 if ok else 0.4,
                "passed": ok}

    res = export_format("onnx_int8", folded, x, tmp_path / "auto", {"fp32_slow_layers": False}, onnx=src.path,
                        calibration=calib, judge=judge)
    times = res.meta["layout_p50_ms"]
    faster, slower = sorted(times, key=times.get)
    assert calls == [(len(x), 3)] * 2 and res.meta["layout"] == slower
    assert res.accuracy["passed"] and set(res.meta["layout_accuracy"]) == {faster, slower}
    assert "a faster candidate failed the accuracy gate" in res.meta["layout_reason"] and f"{faster} lost 0.4" in res.meta["layout_reason"]
    chosen = {n.op_type for n in onnx.load(str(res.path)).graph.node}
    assert ("QLinearConv" in chosen) == (slower == "qoperator")


def test_int8_layers_are_profiled_and_the_slow_ones_offered_in_fp32(tiny_student, tmp_path, monkeypatch):
    """The profile matches the fp32 graph's convolutions in both files; the layers it finds slower become a candidate
    that keeps them in fp32, timed beside the fully quantized ones."""
    import onnx

    import vfm_toolchain.export.formats.onnx_quantized_format as q
    from vfm_toolchain.export.layer_profile import slower_layers

    _present("onnx_int8")
    folded, x = tiny_student
    src = export_format("onnx", folded, x, tmp_path / "fp32", {"opset": 17})
    calib = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)
    full = export_format("onnx_int8", folded, x, tmp_path / "full", {"layout": "qoperator", "fp32_slow_layers": False},
                         onnx=src.path, calibration=calib)
    convs = {n.name for n in onnx.load(str(src.path)).graph.node if n.op_type == "Conv"}
    slow, profile = slower_layers(src.path, full.path, (1, 3, SIZE, SIZE))
    assert len(set(profile) & convs) >= len(convs) // 2  # most convolutions matched by name in both files
    assert all(a > 0 and b > 0 for a, b in profile.values()) and set(slow) == {k for k, (a, b) in profile.items() if b > a}
    assert not list((tmp_path / "fp32").glob("*.json")) and not list((tmp_path / "full").glob("*.json"))  # traces gone

    chosen = sorted(convs)[:2]  # the profile is this CPU's; inject which layers it found slower
    monkeypatch.setattr(q, "slower_layers", lambda *a: (chosen, {k: (0.1, 0.3) for k in chosen}))
    timed = [3.0, 2.0, 1.0, 4.0]  # in the order written: qdq, qoperator, then the same with the layers fp32
    monkeypatch.setattr(q, "_time_candidates", lambda files: dict(zip(files, timed)))
    res = export_format("onnx_int8", folded, x, tmp_path / "auto", onnx=src.path, calibration=calib)
    assert res.meta["layout_p50_ms"] == {"qdq": 3.0, "qoperator": 2.0, "qdq, 2 slow layers fp32": 1.0,
                                         "qoperator, 2 slow layers fp32": 4.0}
    assert res.meta["slow_layers_ms"] == {k: (0.1, 0.3) for k in chosen}
    assert res.meta["layers_fp32"] == chosen and res.meta["layout"] == "qdq"
    assert "qdq, 2 slow layers fp32 ran fastest" in res.meta["layout_reason"]
    nodes = onnx.load(str(res.path)).graph.node
    dequantized = {n.output[0] for n in nodes if n.op_type == "DequantizeLinear"}
    kept_float = {n.name for n in nodes if n.op_type == "Conv" and n.input[1] not in dequantized}  # qdq: Q/DQ around
    assert kept_float == set(res.meta["layers_fp32"])  # exactly those convolutions stayed float
    assert sorted(p.name for p in (tmp_path / "auto").iterdir()) == ["model.int8.onnx"]


def test_openvino_int8_keeps_the_layers_int8_slows_in_fp32_when_the_model_is_then_faster(tiny_student, tmp_path,
                                                                                          monkeypatch):
    """The plugin's per-layer counters are matched by name in the fp32 and the int8 IR; the layers slower in int8 are
    quantized no more, and that IR is kept only when it runs faster side by side."""
    _present("openvino_int8")
    import openvino as ov

    import vfm_toolchain.export.runtimes.measure as measure
    import vfm_toolchain.export.runtimes.openvino_runtime as ovr

    folded, x = tiny_student
    calib = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)
    real = export_format("openvino_int8", folded, x, tmp_path / "real", calibration=calib)
    convs = [op.get_friendly_name() for op in ov.Core().read_model(str(real.path)).get_ops()
             if op.get_type_name() in ("Convolution", "GroupConvolution", "MatMul")]
    assert real.meta["layers_profiled"] >= len(convs) // 2  # most convolutions timed in both IRs, by name
    assert set(real.meta.get("slow_layers_ms", {})) <= set(convs)

    def quantized(path):  # convolutions whose input a FakeQuantize writes
        return {op.get_friendly_name() for op in ov.Core().read_model(str(path)).get_ops()
                if op.get_type_name() in ("Convolution", "GroupConvolution")
                and op.input_value(0).get_node().get_type_name() == "FakeQuantize"}

    chosen = sorted(quantized(export_format("openvino_int8", folded, x, tmp_path / "plain",
                                            {"fp32_slow_layers": False}, calibration=calib).path))[:2]
    monkeypatch.setattr(ovr, "layers", lambda path, x, **k: {"rows": [  # the profile is this CPU's: inject one
        {"name": n, "ms": (0.3 if ".int8." in str(path) else 0.1) if n in chosen else 0.1} for n in convs]})
    for faster, kept in ((True, chosen), (False, [])):
        monkeypatch.setattr(measure, "round_robin", lambda runs, *a, **k: {"int8": 2.0, "slow fp32": 1.0 if faster
                                                                            else 3.0})
        res = export_format("openvino_int8", folded, x, tmp_path / str(faster), calibration=calib)
        assert res.meta["slow_layers_ms"] == {n: (0.1, 0.3) for n in chosen}
        assert res.meta.get("layers_fp32", []) == kept
        assert not set(kept) & quantized(res.path) and set(chosen) - set(kept) <= quantized(res.path)
        assert sorted(p.name for p in (tmp_path / str(faster)).iterdir()) == ["model.int8.bin", "model.int8.xml"]


def test_tflite_int8_keeps_the_output_layer_float_unless_asked_for_integer_end_to_end(tiny_student, tmp_path):
    """int8 logits flip near-tied classes (docs/results.md: -2.35 points on CIFAR-10), so by default the classifier's matmul
    computes and returns float while every other layer is int8; float_output=False gives integer I/O for NPUs."""
    _present("tflite_int8")
    from ai_edge_litert.interpreter import Interpreter

    folded, x = tiny_student
    calib = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)

    def layers(path):
        it = Interpreter(model_path=str(path))
        dtype = {t["index"]: t["dtype"] for t in it.get_tensor_details()}
        ops = [(o["op_name"], dtype[o["outputs"][0]]) for o in it._get_ops_details()]
        return ops, it.get_output_details()[0]["dtype"]

    mixed = export_format("tflite_int8", folded, x, tmp_path / "mixed", calibration=calib)
    integer = export_format("tflite_int8", folded, x, tmp_path / "int", {"float_output": False}, calibration=calib)
    ops, out = layers(mixed.path)
    assert mixed.meta["float_ops"] == ["FULLY_CONNECTED"] and out == np.float32
    assert [d for op, d in ops if op == "FULLY_CONNECTED"] == [np.float32]
    assert all(d == np.int8 for op, d in ops if op in ("CONV_2D", "DEPTHWISE_CONV_2D"))
    ops, out = layers(integer.path)
    assert integer.meta["float_ops"] == [] and out == np.int8
    assert [d for op, d in ops if op == "FULLY_CONNECTED"] == [np.int8]
    assert np.asarray(mixed.runner(x.numpy())).shape == np.asarray(integer.runner(x.numpy())).shape == (len(x), 3)


def test_android_script_pushes_each_phone_artifact_and_runs_its_runtimes_benchmark():
    from vfm_toolchain.bench.bundle import android_script

    script = android_script([{"label": "student executorch", "file": "student_executorch.pte", "runtime": "executorch"},
                             {"label": "student tflite_int8", "file": "student_tflite_int8.int8.tflite",
                              "runtime": "litert"}])
    assert script.startswith("#!/bin/sh") and "Not verified" in script
    assert 'adb push "student_executorch.pte" "$DIR/student_executorch.pte"' in script
    assert "./executor_runner -model_path student_executorch.pte" in script
    assert "benchmark_model --graph=$DIR/student_tflite_int8.int8.tflite" in script and "--use_xnnpack=true" in script


def test_report_recommends_the_fastest_measured_artifact_per_target_and_says_what_was_not_timed():
    from vfm_toolchain.bench.report import recommendations

    ok = lambda kind, **kw: {"model": "student", "kind": kind, "status": "ok", **kw}  # noqa: E731
    artifacts = [ok("onnx"), ok("onnx_int8", precision="int8", accuracy_drop=0.004), ok("openvino"), ok("tflite"),
                 ok("coreml", parity_skipped="needs macOS"),
                 {"model": "student", "kind": "tensorrt", "status": "skipped", "reason": "no GPU"}]
    row = lambda kind, runtime, ms, provider=None, **kw: {"artifact": f"student {kind}", "runtime": runtime,  # noqa
                                                          "batch": 1, "p50_ms": ms, "provider": provider, **kw}
    bench = [row("onnx", "onnxruntime", 10.0, "CPUExecutionProvider"),
             row("onnx_int8", "onnxruntime", 8.0, "CPUExecutionProvider", unstable="machine busy"),
             row("openvino", "openvino", 9.0, "openvino CPU"), row("tflite", "litert", 15.0, "xnnpack (2 threads)")]
    recs = {r["target"]: r for r in recommendations(bench, artifacts)}
    assert recs["x86"]["artifact"] == "openvino" and "onnx 10.00 ms" in recs["x86"]["why"]  # the unstable int8 row
    assert "onnx_int8" not in recs["x86"]["why"]                                             # is not a measurement
    assert recs["android"]["artifact"] == "tflite" and "indicative" in recs["android"]["why"]
    assert recs["ios"]["artifact"] == "coreml" and "not timed here" in recs["ios"]["why"]
    # a CPU row says nothing for nvidia: no TensorRT or CUDA ONNX Runtime row was measured
    assert recs["nvidia"]["artifact"] == "onnx" and "no TensorRT engine or CUDA ONNX Runtime" in recs["nvidia"]["why"]
    bench[1].pop("unstable")                                                                  # about a GPU
    x86 = next(r for r in recommendations(bench, artifacts) if r["target"] == "x86")
    assert x86["artifact"] == "onnx_int8" and "passed its accuracy gate" in x86["why"]


@pytest.mark.parametrize("fmt", ["executorch", "tflite", "openvino"])
def test_segmentation_student_exports_to_each_on_device_format_with_parity(fmt, tmp_path):
    """The DeepLabV3 form of a student (output stride 8, upsampled logits) through each on-device format: per-pixel
    logits at the input's size, matching the folded model."""
    from vfm_toolchain.students.models import create_student

    _present(fmt)
    torch.manual_seed(0)
    model = create_student("fastvit_t8", 3, task="segmentation").eval()
    x = torch.randn(2, 3, 64, 64)
    folded, _ = fold_model(model, {"family": "student"}, x)
    res = export_format(fmt, folded, x, tmp_path)
    with torch.no_grad():
        ref = folded(x).numpy()
    out = np.asarray(res.runner(x.numpy()))
    assert out.shape == ref.shape == (2, 3, 64, 64)
    assert np.abs(out - ref).max() < 1e-3


def test_a_dilated_resnet_segmentation_student_runs_int8_on_xnnpack(tmp_path):
    """resnet10t at output stride 8 (recipes/stanford_background.yaml's student): before the same_avg_pool fold its
    shortcuts' asymmetric pad made XNNPACK refuse the int8 program at load time; folded, it loads and runs, its
    per-pixel logits near the fp32 model's."""
    from vfm_toolchain.students.models import create_student

    _present("executorch_int8")
    torch.manual_seed(0)
    model = create_student("timm:resnet10t", 3, task="segmentation").eval()
    x = torch.randn(1, 3, 48, 64)
    folded, _ = fold_model(model, {"family": "student"}, x)
    calib = np.random.default_rng(0).standard_normal((4, 3, 48, 64)).astype(np.float32)
    res = export_format("executorch_int8", folded, x, tmp_path, {"fallback": False}, calibration=calib)
    with torch.no_grad():
        ref = folded(x).numpy()
    out = np.asarray(res.runner(x.numpy()))
    assert out.shape == ref.shape and "float_modules" not in res.meta
    assert np.abs(out - ref).max() < 0.25 * np.abs(ref).max()


def test_bench_runtimes_auto_times_every_exported_format_on_its_own_runtime():
    from vfm_toolchain.bench.latency import timed_runtimes

    arts = [{"kind": k, "status": "ok"} for k in ("onnx", "onnx_int8", "executorch", "tflite", "openvino")]
    arts.append({"kind": "tensorrt", "status": "skipped"})
    assert timed_runtimes(["auto"], arts) == ["pytorch", "onnxruntime", "executorch", "litert", "openvino"]
    assert timed_runtimes(["onnxruntime_cpu", "auto"], arts[:1]) == ["onnxruntime_cpu", "pytorch", "onnxruntime"]
    with pytest.raises(Exception, match="unknown runtime"):
        timed_runtimes(["onnxruntme"], arts)


def test_openvino_conversion_sends_no_telemetry_from_a_forked_process(tiny_student, tmp_path, monkeypatch):
    """OpenVINO's converter and NNCF fork a process to send usage telemetry unless the user opted out; a build must
    neither phone home nor fork a process full of runtime threads."""
    import multiprocessing

    _present("openvino_int8")
    started = []
    monkeypatch.setattr(multiprocessing.Process, "start", lambda self: started.append(self))
    folded, x = tiny_student
    export_format("openvino", folded, x, tmp_path / "fp32")
    export_format("openvino_int8", folded, x, tmp_path / "int8", calibration=x.numpy())
    assert started == []
