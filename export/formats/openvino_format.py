"""OpenVINO (x86 edge: Intel NUCs, industrial PCs, Intel iGPU/NPU): ``openvino`` (fp32) and ``openvino_int8`` IR,
a ``model.xml`` graph with its ``model.bin`` weights beside it.

The IR is converted from the folded PyTorch model (``openvino.convert_model``, OpenVINO's own PyTorch frontend)
with a free batch dimension, and saved with fp32 weights (``save_model`` would halve them to fp16 by default,
which is a different artifact from the one checked).  ``openvino_int8`` is NNCF post-training quantization on
transfer-set images: int8 weights and activations, with NNCF's transformer rules (``model_type:
transformer``) for models with attention so that softmax and layer-norm inputs stay in floating point;
the stage judges it by test accuracy against fp32 (``export.max_accuracy_drop``); one that misses it is quantized
again by NNCF's ``quantize_with_accuracy_control`` on the gate's images (``_accuracy_control``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Literal

import numpy as np
import torch
from pydantic import Field

from vfm_toolchain.export.formats.base import (EDGE_INSTALL, ExportInputs, ExportResult, FormatOptions,
                                               Int8FormatOptions, format_options, register_format)
from vfm_toolchain.students.fold import holds_nms

__all__ = ["export_openvino", "export_openvino_int8", "weights_file"]


def weights_file(xml: Path) -> Path:
    """The ``.bin`` an IR's ``.xml`` reads its weights from (same stem, same folder: it must travel with it)."""
    return Path(xml).with_suffix(".bin")


def _convert(model: torch.nn.Module, example: torch.Tensor):
    """The IR, from the PyTorch model; a detector with its NMS through its ONNX graph instead: OpenVINO's ONNX
    frontend maps ``NonMaxSuppression`` to OpenVINO's own NMS op, where its PyTorch frontend cannot read the eager
    NMS (data-dependent ``aten::empty``)."""
    from vfm_toolchain.export.runtimes.openvino_runtime import import_openvino, no_telemetry

    ov = import_openvino()
    with no_telemetry():
        if holds_nms(model):
            import tempfile

            from vfm_toolchain.export.formats.onnx_format import export_onnx

            with tempfile.TemporaryDirectory(prefix="openvino_onnx_") as tmp:
                onnx_file = export_onnx(model, example, Path(tmp), format_options("onnx"), ExportInputs()).path
                ir = ov.convert_model(str(onnx_file))
        else:
            ir = ov.convert_model(model.eval(), example_input=example[:1])
    ir.reshape({ir.inputs[0]: ov.PartialShape([-1, *example.shape[1:]])})  # any batch, the build's image size
    return ir


def _save(ir, path: Path) -> None:
    """Write ``model.xml`` + ``model.bin`` so that neither is ever half-written: both go to a temporary stem,
    the ``.bin`` is renamed first, and the ``.xml`` (what loads) last."""
    import os

    import openvino as ov

    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.xml")
    ov.save_model(ir, str(tmp), compress_to_fp16=False)
    os.replace(weights_file(tmp), weights_file(path))
    os.replace(tmp, path)


def _result(path: Path, meta) -> ExportResult:
    from vfm_toolchain.export.runtimes.openvino_runtime import load as load_openvino  # parity runs what is timed

    return ExportResult(path, meta, runner=load_openvino(path))


@register_format("openvino", runtime="openvino", requires=("openvino",), install=EDGE_INSTALL, targets=("x86",),
                 suffix=".xml (+ .bin)",
                 devices="x86 cpu, intel gpu / npu")
def export_openvino(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                    inputs: ExportInputs) -> ExportResult:
    path, t0 = Path(out_dir) / "model.xml", time.time()
    _save(_convert(model, example), path)
    return _result(path, {"precision": "fp32", "seconds": round(time.time() - t0, 2)})


class OpenVINOInt8Options(Int8FormatOptions):
    model_type: Literal["auto", "cnn", "transformer"] = Field(
        "auto", description="transformer keeps softmax / layer-norm inputs in float (NNCF ModelType.TRANSFORMER); "
                            "auto: transformer when the model has attention")
    preset: Literal["performance", "mixed"] = Field("performance", description="NNCF preset: performance "
                                                    "(symmetric activations) or mixed (asymmetric, more accurate)")
    fast_bias_correction: bool = True
    ignored_types: List[str] = Field([], description="OpenVINO op types left in float, e.g. [MatMul]")
    fp32_slow_layers: bool = Field(
        True, description="time every convolution / matmul in fp32 and int8 on this CPU (the plugin's performance "
                          "counters, batch 1) and also try the model with the layers int8 slows down kept in fp32; "
                          "the faster is kept")


SLOW_PROFILE = {"warmup": 5, "runs": 20}  # batch-1 calls per IR for the per-layer times


def _has_attention(model: torch.nn.Module) -> bool:
    return any(isinstance(m, (torch.nn.MultiheadAttention, torch.nn.LayerNorm, torch.nn.GroupNorm)) or
               "attention" in type(m).__name__.lower() for m in model.modules())


@register_format("openvino_int8", options=OpenVINOInt8Options, runtime="openvino",
                 requires=("openvino", "nncf"), install=EDGE_INSTALL, targets=("x86",), suffix=".int8.xml (+ .bin)",
                 precision="int8", devices="x86 cpu (VNNI / AMX best), intel gpu / npu")
def export_openvino_int8(model: torch.nn.Module, example: torch.Tensor, out_dir: Path,
                         options: OpenVINOInt8Options, inputs: ExportInputs) -> ExportResult:
    from vfm_toolchain.export.runtimes.openvino_runtime import no_telemetry

    with no_telemetry():
        import nncf

    path, t0 = Path(out_dir) / "model.int8.xml", time.time()
    calib = inputs.need_calibration("openvino_int8")
    kind = options.model_type if options.model_type != "auto" else \
        "transformer" if _has_attention(model) else "cnn"
    data = nncf.Dataset([np.ascontiguousarray(image[None], dtype=np.float32) for image in calib])
    settings = dict(subset_size=len(calib), fast_bias_correction=options.fast_bias_correction,
                    preset=nncf.QuantizationPreset(options.preset),
                    model_type=nncf.ModelType.TRANSFORMER if kind == "transformer" else None,
                    ignored_scope=nncf.IgnoredScope(types=options.ignored_types) if options.ignored_types else None)
    with no_telemetry():
        ptq = nncf.quantize(_convert(model, example), data, **settings)
    _save(ptq, path)
    meta = {"precision": "int8", "calibration_images": int(len(calib)), "model_type": kind, "preset": options.preset}
    if options.fp32_slow_layers:
        ptq, settings = _keep_slow_layers_fp32(model, example, ptq, data, settings, path, calib[:1], meta, inputs)
    res = _result(path, meta)
    gate = inputs.judge
    if gate is not None:  # judged here, so that a miss can be repaired
        res.accuracy = gate(res.runner)
        if not res.accuracy["passed"] and options.fallback and len(getattr(gate, "items", ())):
            res.runner, res.accuracy, res.meta["fallback"] = _accuracy_control(model, example, ptq, data, settings,
                                                                               path, gate, (res.runner, res.accuracy),
                                                                               inputs)
    res.meta["seconds"] = round(time.time() - t0, 2)
    return res


def _keep_slow_layers_fp32(model, example, ptq, data, settings, path: Path, x: np.ndarray, meta, inputs: ExportInputs):
    """The layers int8 makes slower here, back in fp32, when the whole model is then faster.  Some are (the Aquarium
    detector's first convolution, 3 input channels: 0.70 ms fp32 against 1.18 int8, docs/results.md), but a float
    layer between int8 ones costs conversions too, so only the whole IR's time decides.  Each convolution / matmul
    is timed in the fp32 and the int8 IR by the plugin's performance counters (the runtime layer's table, batch 1, a
    calibration image); those slower in int8 are left out of quantization (``IgnoredScope`` by name), and the two
    IRs are then timed side by side, the faster kept.  Returns the IR kept and the NNCF settings that made it (the
    accuracy fallback starts from them); ``meta`` gets the profile and the choice."""
    import tempfile

    import nncf

    from vfm_toolchain.export.fallback import FALLBACK_TIMING
    from vfm_toolchain.export.runtimes.measure import round_robin
    from vfm_toolchain.export.runtimes.openvino_runtime import layers, load as load_openvino, no_telemetry

    weighted = {"Convolution", "GroupConvolution", "MatMul"}
    names = {op.get_friendly_name() for op in ptq.get_ops() if op.get_type_name() in weighted}
    with tempfile.TemporaryDirectory(prefix="openvino_slow_") as tmp:
        fp32 = Path(tmp) / "model.xml"
        _save(_convert(model, example), fp32)
        timed = [{r["name"]: r["ms"] for r in layers(f, x, **SLOW_PROFILE)["rows"] if r["name"] in names}
                 for f in (fp32, path)]
        profile = {n: (round(timed[0][n], 4), round(timed[1][n], 4)) for n in sorted(names)
                   if n in timed[0] and n in timed[1]}
        slow = [n for n, (a, b) in profile.items() if b > a]
        meta["layers_profiled"] = len(profile)
        if not slow:
            return ptq, settings
        ignored = nncf.IgnoredScope(names=slow, types=list(settings["ignored_scope"].types)
                                    if settings.get("ignored_scope") else [])
        kept = {**settings, "ignored_scope": ignored}
        inputs.say(f"openvino_int8: {len(slow)} of {len(profile)} layers run slower in int8 here; trying them in fp32")
        with no_telemetry():
            candidate = nncf.quantize(_convert(model, example), data, **kept)
        other = Path(tmp) / "model.int8.xml"
        _save(candidate, other)
        times = round_robin({"int8": load_openvino(path), "slow fp32": load_openvino(other)}, x, **FALLBACK_TIMING)
        meta["slow_layers_ms"] = {n: profile[n] for n in slow}  # (fp32, int8) per call, this CPU
        meta["slow_layers_p50_ms"] = {k: round(v, 3) for k, v in times.items()}
        if times["slow fp32"] >= times["int8"]:
            return ptq, settings
        _save(candidate, path)
    meta["layers_fp32"] = slow
    return candidate, kept


def _accuracy_control(model, example, ptq, data, settings, path: Path, gate, first, inputs: ExportInputs):
    """NNCF's ``quantize_with_accuracy_control``: it ranks the quantized layers by what reverting each does to the
    gate's own metric (per image) on the gate's own images, and reverts them in that order until the drop is within
    ``export.max_accuracy_drop``; the artifact is then judged by the gate like any other.  The gate's images, as the
    other formats' fallback steps are judged: on the val split (250 CIFAR-10 images, a binomial standard error of 3
    points at 64%) NNCF reverted 10 layers and the test drop stayed 0.75 against a 0.3 bound.  The record has the
    shape of export/fallback.py's: the plain int8 step, the repaired one, each timed beside fp32."""
    import tempfile

    import nncf

    from vfm_toolchain.export.fallback import FALLBACK_TIMING, step_record
    from vfm_toolchain.export.runtimes.measure import round_robin
    from vfm_toolchain.export.runtimes.openvino_runtime import load as load_openvino, no_telemetry

    def validate(compiled, items):
        run = lambda a: np.asarray(compiled(np.ascontiguousarray(a, dtype=np.float32))[0])
        return gate.score(run, list(items)), None  # (metric, None): NNCF scores single items itself to rank

    inputs.say(f"openvino_int8: test {first[1]['test_score']:.4f} is {first[1]['accuracy_drop']:.4f} below fp32, "
               f"over the gate; NNCF's accuracy control reverts layers ranked on the gate's {len(gate.items)} images")
    with no_telemetry():
        repaired = nncf.quantize_with_accuracy_control(
            _convert(model, example), data, nncf.Dataset(list(gate.items)), validate, max_drop=gate.max_drop,
            drop_type=nncf.DropType.ABSOLUTE, **settings)
    float_layers = sorted(_int8_layers(ptq) - _int8_layers(repaired))
    _save(repaired, path)
    runner = load_openvino(path)
    verdict = gate(runner)
    x = np.ascontiguousarray(example[:1].numpy(), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="openvino_fp32_") as tmp:
        fp32 = Path(tmp) / "model.xml"
        _save(_convert(model, example), fp32)
        times = round_robin({"ptq": first[0], "int8": runner, "fp32": load_openvino(fp32)}, x, **FALLBACK_TIMING)
    passed = bool(verdict["passed"])
    record = {"method": "nncf.quantize_with_accuracy_control", "ranked_layers": len(_int8_layers(ptq)),
              "float_layers": float_layers, "fp32_p50_ms": round(times["fp32"], 3), "passed": passed,
              "verdict": verdict,
              "steps": [step_record(0, first[1], times["ptq"], times["fp32"]),
                        step_record(len(float_layers), verdict, times["int8"], times["fp32"])],
              "reason": f"NNCF reverted {len(float_layers)} layers; the gate "
                        f"{'passes' if passed else 'still refuses'} it"}
    return runner, verdict, record


def _int8_layers(ir) -> set:
    """Names of the convolutions and matrix multiplies of an IR whose input is quantized (a FakeQuantize feeds it)."""
    weighted = {"Convolution", "GroupConvolution", "MatMul", "ConvolutionBackpropData"}
    return {op.get_friendly_name() for op in ir.get_ops() if op.get_type_name() in weighted
            and op.input_value(0).get_node().get_type_name() == "FakeQuantize"}
