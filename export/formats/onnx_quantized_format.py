"""ONNX Runtime reduced precision: ``onnx_fp16`` (weights and activations in float16, float32 inputs and
outputs) and ``onnx_int8`` (static QDQ quantization, int8 weights per channel, uint8 activations
calibrated on transfer-set images).  Both start from the fp32 ONNX artifact, so ``onnx`` must come first
in ``export.formats``; its external data, if any, is read, and the smaller result is written as one file.
``quantize_qdq(..., symmetric=True)`` makes the int8 QDQ file that TensorRT's explicit quantization builds
its int8 engines from (``tensorrt_format``).

Output drift says little about an int8 model (logits move by whole units while the argmax holds), so
the stage judges these artifacts by their accuracy on the test set against the fp32 model and refuses
one whose drop exceeds ``export.max_accuracy_drop``, after export/fallback.py has tried putting its most sensitive
layers (their ONNX nodes, :func:`layer_nodes`) back in fp32.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import torch

from pydantic import Field

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write
from vfm_toolchain.export.formats.base import (ExportInputs, ExportResult, FormatOptions, Int8FormatOptions,
                                               register_format)
from vfm_toolchain.export.formats.onnx_format import ORT_INSTALL, cpu_runner, external_data_file
from vfm_toolchain.export.layer_profile import slower_layers
from vfm_toolchain.students.fold import holds_nms

__all__ = ["export_onnx_fp16", "export_onnx_int8", "layer_nodes", "postprocess_nodes", "quantize_qdq"]

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")  # the ONNX ops that hold a layer's weights
ELEMENTWISE = "ops without weights"  # the fallback's first entry: every op but WEIGHTED_OPS left in fp32


@register_format("onnx_fp16", runtime="onnxruntime", source="onnx", requires=("onnxruntime",), install=ORT_INSTALL,
                 targets=("nvidia",), suffix=".fp16.onnx", precision="fp16",
                 devices="gpu (cuda, tensorrt EPs); cpu runs it slowly")
def export_onnx_fp16(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                     inputs: ExportInputs) -> ExportResult:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    src, path, t0 = inputs.need_onnx("onnx_fp16"), Path(out_dir) / "model.fp16.onnx", time.time()
    # LayerNorm / Softmax / reductions overflow or lose too much in fp16 in ViTs: keep them in fp32
    keep = ["LayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt", "Erf"]
    proto = onnx.load(str(src))
    nms = _nms_nodes(proto)
    if nms:  # a detector: NonMaxSuppression takes float32 only, its thresholds included; Range (the location
        keep += ["NonMaxSuppression", "Range"]  # grid) has no float16 kernel in ONNX Runtime
    proto = _without_repeated_nodes(convert_float_to_float16(proto, keep_io_types=True, op_block_list=keep,
                                                             node_block_list=nms))
    atomic_write(path, lambda tmp: onnx.save(proto, str(tmp)))
    return ExportResult(path, {"precision": "fp16", "fp32_ops": keep, "seconds": round(time.time() - t0, 2)},
                        runner=cpu_runner(path))


def _without_repeated_nodes(proto):
    """Drop a node that repeats an earlier one exactly (name, inputs, outputs, attributes): the fp16 converter casts
    an initializer that two blocked nodes read once per reader, under one name (a detector's location grid,
    read by two Range nodes), which ONNX refuses as two nodes with the same name."""
    seen, keep = set(), []
    for node in proto.graph.node:
        key = node.SerializeToString()
        if key not in seen:
            seen.add(key)
            keep.append(node)
    if len(keep) < len(proto.graph.node):
        del proto.graph.node[:]
        proto.graph.node.extend(keep)
    return proto


def _nms_nodes(proto) -> List[str]:
    """The names of a detector's ``NonMaxSuppression`` nodes and of the ``Constant`` nodes giving their thresholds,
    which fp16 conversion must leave in float32 (ONNX's NMS is defined on float32 only)."""
    graph = proto.graph
    producer = {out: node for node in graph.node for out in node.output}
    names = []
    for node in graph.node:
        if node.op_type == "NonMaxSuppression":
            names.append(node.name)
            names += [producer[i].name for i in node.input[2:] if i in producer and producer[i].op_type == "Constant"]
    return names


class _Calibration:
    """onnxruntime's CalibrationDataReader protocol over preprocessed images, one at a time."""

    def __init__(self, images: np.ndarray):
        self.images, self.i = images, 0

    def get_next(self):
        if self.i >= len(self.images):
            return None
        self.i += 1
        return {"input": self.images[self.i - 1:self.i]}

    def rewind(self):
        self.i = 0


def quantize_qdq(src: Path, dst: Path, calibration: np.ndarray, per_channel: bool = True,
                 symmetric: bool = False, layout: str = "qdq", exclude: Sequence[str] = (),
                 reduce_range: bool = False, op_types: Optional[Sequence[str]] = None) -> None:
    """Static QDQ quantization of the fp32 ONNX file ``src`` into ``dst`` (one file), calibrated with MinMax on
    ``calibration`` (the formats get it through ``ExportInputs.need_calibration``, which refuses none).

    ``symmetric=False`` is ONNX Runtime's CPU form: int8 weights, uint8 activations with a zero point.
    ``symmetric=True`` is what TensorRT's explicit quantization accepts: int8 activations and weights with
    zero point 0 (TensorRT quantizes symmetrically only), the input of ``tensorrt`` int8 engines.
    ``layout="qoperator"`` writes fused integer operators (QLinearConv, QLinearMatMul) instead of Q/DQ pairs
    around float operators: ONNX Runtime's CPU kernels run either, at different speeds per model and CPU.
    ``exclude`` names nodes of ``src`` left in fp32; ``op_types`` (ONNX op types) limits quantization to those.
    ``reduce_range`` quantizes weights to 7 bits: on x86 CPUs without VNNI, ONNX Runtime's int8 kernels multiply
    through AVX2's u8s8 instruction, whose 16-bit intermediate saturates with full-range weights (ONNX Runtime's
    quantization docs); 7 bits cannot saturate it.
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    pre, inline = dst.with_name(dst.stem + ".pre.onnx"), dst.with_name(dst.stem + ".inline.onnx")
    if external_data_file(src).is_file():
        # onnxruntime's pre-processor loses external data (it copies the model to a temporary folder
        # without it): hand it the weights inline, which protobuf allows below 2 GB
        proto = onnx.load(str(src))
        if proto.ByteSize() >= 2 ** 31:
            raise ToolchainError("int8: the fp32 model is over 2 GB, which onnxruntime's quantization "
                                 "pre-processing cannot read")
        onnx.save(proto, str(inline))
        src = inline
    quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)  # shape inference + graph clean-up
    inline.unlink(missing_ok=True)

    def write(tmp: Path) -> None:
        quantize_static(str(pre), str(tmp), _Calibration(np.asarray(calibration, dtype=np.float32)),
                        quant_format=QuantFormat.QOperator if layout == "qoperator" else QuantFormat.QDQ,
                        per_channel=per_channel, weight_type=QuantType.QInt8,
                        activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=list(exclude),
                        op_types_to_quantize=list(op_types) if op_types else None,
                        reduce_range=reduce_range,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else {})

    try:
        with _quiet_quantizer():
            atomic_write(dst, write)
    finally:
        pre.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_quantizer():
    """ONNX Runtime's quantizer logs through the root logger, at INFO, one line per bias it copies and per weight
    axis it checks: hundreds of lines in the build's log for one detector.  Its errors still pass."""
    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname.replace("\\", "/")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


class Int8Options(Int8FormatOptions):
    per_channel: bool = Field(True, description="int8 weights with one scale per output channel")
    layout: Literal["auto", "qdq", "qoperator"] = Field(
        "auto", description="qdq (Q/DQ pairs, what TensorRT and most EPs read), qoperator (fused QLinear ops), "
                            "or auto: both written and timed here on the CPU, the faster kept")
    reduce_range: bool = Field(
        False, description="7-bit weights, for x86 CPUs without VNNI (AVX2 only), where ONNX Runtime's int8 "
                           "multiply saturates with 8-bit weights and accuracy drops; costs a little precision")
    fp32_slow_layers: bool = Field(
        True, description="profile every convolution / matmul in fp32 and int8 on this CPU and also try the "
                          "model with the layers int8 slows down kept in fp32; timing and the accuracy gate choose")


# batch 1 on the build machine's CPU, as ONNX Runtime serves it; candidates in turn, so a busy machine's drift hits all
LAYOUT_TIMING = {"warmup": 3, "rounds": 6, "per_round": 5}


def _time_candidates(files: Dict[str, Path]) -> Dict[str, float]:
    from vfm_toolchain.export.runtimes.measure import round_robin

    x = np.random.default_rng(0).standard_normal(_input_shape(next(iter(files.values())))).astype(np.float32)
    return round_robin({name: cpu_runner(path) for name, path in files.items()}, x, **LAYOUT_TIMING)


def _input_shape(path: Path):
    """The input's shape with every free dimension (batch) at 1."""
    import onnx

    dims = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else 1 for d in dims]


@register_format("onnx_int8", options=Int8Options, runtime="onnxruntime", source="onnx", requires=("onnxruntime",),
                 install=ORT_INSTALL, targets=("cpu", "x86"), suffix=".int8.onnx", precision="int8",
                 devices="cpu (VNNI / ARM dot-product), gpu via tensorrt EP")
def export_onnx_int8(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: Int8Options,
                     inputs: ExportInputs) -> ExportResult:
    """The candidates (each layout of ``options.layout``, and each again with its slow layers in fp32) are written,
    timed at batch 1 on this CPU and judged fastest first; one candidate is written without timing."""
    src, path, t0 = inputs.need_onnx("onnx_int8"), Path(out_dir) / "model.int8.onnx", time.time()
    calib = inputs.need_calibration("onnx_int8")
    meta = {"precision": "int8", "calibration_images": int(len(calib)), "per_channel": options.per_channel,
            "reduce_range": options.reduce_range}
    post = postprocess_nodes(src) if holds_nms(model) else []
    if post:
        meta["postprocess_fp32_nodes"] = len(post)

    def write(name: str, layout: str, exclude: Sequence[str] = (), op_types: Optional[Sequence[str]] = None) -> Path:
        file = path.with_name(f"model.int8.candidate{next(numbers)}.onnx")
        quantize_qdq(src, file, calib, options.per_channel, symmetric=False, layout=layout, exclude=[*post, *exclude],
                     reduce_range=options.reduce_range, op_types=op_types)
        files[name] = (file, layout, list(exclude))
        return file

    files: Dict[str, Tuple[Path, str, List[str]]] = {}  # candidate -> (file, layout, layers kept fp32)
    numbers = itertools.count()
    layouts = ("qdq", "qoperator") if options.layout == "auto" else (options.layout,)
    for layout in layouts:
        write(layout, layout)
    if options.fp32_slow_layers:  # the per-layer profile is read from the fused integer operators
        probe = files["qoperator"][0] if "qoperator" in files else write("qoperator (profile)", "qoperator")
        slow, profile = slower_layers(src, probe, _input_shape(src))
        files.pop("qoperator (profile)", None)
        meta["layers_profiled"] = len(profile)
        if slow:
            for layout in layouts:
                write(f"{layout}, {len(slow)} slow layers fp32", layout, slow)
            meta["slow_layers_ms"] = {k: profile[k] for k in slow}  # (fp32, int8) per call, this CPU
    accuracy = None
    if len(files) == 1:
        (best,) = files
        if inputs.judge is not None and options.fallback:  # judged here, so that a miss can be repaired
            accuracy = inputs.judge(cpu_runner(files[best][0]))
    else:  # chosen by measurement on this machine, every candidate recorded
        times = {k: round(v, 3) for k, v in _time_candidates({k: f for k, (f, _, _) in files.items()}).items()}
        best, verdicts = _choose_layout(times, {k: v[0] for k, v in files.items()}, inputs.judge)
        meta.update(layout_p50_ms=times, layout_reason=_layout_reason(best, times, verdicts))
        if verdicts:
            meta["layout_accuracy"] = {k: round(v["test_score"], 4) for k, v in verdicts.items()}
            accuracy = verdicts.get(best)
    if accuracy is not None and not accuracy["passed"] and options.fallback:
        best, accuracy, meta["fallback"] = _fall_back(model, example, src, files, best, accuracy, inputs, write)
    os.replace(files[best][0], path)
    meta.update(layout=files[best][1], layers_fp32=files[best][2])
    for file in path.parent.glob("model.int8.*.onnx"):
        if file != path:
            file.unlink()
    meta["seconds"] = round(time.time() - t0, 2)
    return ExportResult(path, meta, runner=cpu_runner(path), accuracy=accuracy)


def _fall_back(model, example, src: Path, files, best: str, ptq: Dict, inputs: ExportInputs, write):
    """export/fallback.py on ONNX Runtime: the chosen candidate rebuilt with its most sensitive layers' nodes also
    left in fp32 (``nodes_to_exclude``).  Returns the candidate left, its verdict and the fallback's record."""
    from vfm_toolchain.export.fallback import fall_back

    ranked, producers = inputs.fallback_plan(model, example, "onnx_int8")
    nodes = layer_nodes(src)
    ranked = [(name, score) for name, score in ranked if nodes.get(name)]  # a layer fused away has no node
    # first of all, what no layer ranking reaches: ONNX Runtime also quantizes the ops without weights (residual
    # adds, layer-scale multiplies, activations), each output on one per-tensor grid; on a CIFAR-10 FastViT-T8 every
    # weighted layer in fp32 still lost 1.0 top-1 point with them int8 (docs/results.md)
    ranked = [(ELEMENTWISE, float("inf")), *ranked]
    _, layout, kept = files[best]
    made: List[str] = []

    def make(layers: List[str]):
        made.append(f"{layout}, {len(layers)} sensitive layers fp32")
        weighted_only = WEIGHTED_OPS if ELEMENTWISE in layers else None
        # a producer the exporter fused into another node has none of its own
        file = write(made[-1], layout, [*kept, *(n for layer in layers for n in nodes.get(layer, ()))], weighted_only)
        files[made[-1]] = (file, layout, kept)  # layers_fp32 names the slow layers; the record the sensitive ones
        return cpu_runner(file)

    x = np.zeros(_input_shape(src), dtype=np.float32)
    runner, record = fall_back("onnx_int8", ranked, make, inputs.judge, (cpu_runner(files[best][0]), ptq),
                               cpu_runner(src), x, inputs.say, producers)
    return (made[-1] if made else best), record["verdict"], record


def postprocess_nodes(path: Path) -> List[str]:
    """A detector's post-processing nodes in its ONNX graph, which int8 must leave in float: the ops the detector runs
    in its own methods rather than in a submodule (the exporter scopes them at the root, ``/Mul_10``): the levels'
    flattening, the decoding of boxes (pixel coordinates) and scores, and the NMS.  Quantized, they cost a detector
    nearly its whole mAP50 (boxes in pixels do not survive an int8 grid); they hold no weights, so int8 would not
    speed them up."""
    import onnx

    return [n.name for n in onnx.load(str(path), load_external_data=False).graph.node if n.name.count("/") <= 1]


def layer_nodes(path: Path) -> Dict[str, List[str]]:
    """PyTorch module name -> the names of the ONNX nodes of ``path`` that hold its weights (Conv, ConvTranspose, Gemm,
    MatMul), read from the weight's initializer name (the exporter keeps ``<module>.weight``) or else from the
    node's scope (``/detector/stages/stages.0/stages.0.0/Conv``: each scope part is the attribute path so far)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    params = {init.name for init in graph.initializer}
    out: Dict[str, List[str]] = {}
    for node in graph.node:
        if node.op_type not in WEIGHTED_OPS:
            continue
        weight = next((i for i in node.input[1:2] if i in params and i.endswith(".weight")), None)
        module = weight[:-len(".weight")] if weight else scope_module(node.name)
        if module:
            out.setdefault(module, []).append(node.name)
    return out


def scope_module(name: str) -> str:
    """The PyTorch module an ONNX node's scope names (``/stages/stages.0/stages.0.1/conv/Conv`` ->
    ``stages.0.1.conv``)."""
    parts: List[str] = []
    for part in name.strip("/").split("/")[:-1]:  # the last part is the op
        if parts and part.startswith(parts[-1] + "."):
            parts[-1] = part  # 'stages' then 'stages.0': the same attribute path, one level deeper
        else:
            parts.append(part)
    return ".".join(parts)


def _choose_layout(times: Dict[str, float], candidate: Dict[str, Path], judge) -> Tuple[str, Dict[str, Dict]]:
    """The fastest candidate that passes the build's accuracy gate, trying them fastest first (the gate scores the
    test split, so a slower candidate is only scored when a faster one failed).  With no gate (outside a build) or
    none passing, the fastest: the stage then refuses it with the accuracy message."""
    order = sorted(times, key=times.get)
    verdicts: Dict[str, Dict] = {}
    if judge is None:
        return order[0], verdicts
    for name in order:
        verdicts[name] = judge(cpu_runner(candidate[name]))
        if verdicts[name]["passed"]:
            return name, verdicts
    return order[0], verdicts


def _layout_reason(best: str, times: Dict[str, float], verdicts: Dict[str, Dict]) -> str:
    timing = ", ".join(f"{k} {v:.2f} ms" for k, v in times.items())
    failed = [k for k, v in verdicts.items() if not v["passed"]]
    if best in failed or not failed:
        return f"{best} ran fastest at batch 1 on this CPU under ONNX Runtime ({timing})"
    lost = "; ".join(f"{k} lost {verdicts[k]['accuracy_drop']:.4f}" for k in failed)
    return (f"{best} kept: a faster candidate failed the accuracy gate ({lost}, over export.max_accuracy_drop); "
            f"batch-1 times under ONNX Runtime on this CPU: {timing}")
