"""LiteRT (TensorFlow Lite; Android, embedded Linux, microcontrollers): ``tflite`` (fp32), ``tflite_fp16`` (fp16
weights, fp32 compute: half the file, the same speed on a CPU, what a phone GPU delegate runs natively) and
``tflite_int8`` (int8 weights and activations, static, calibrated on transfer-set images).

``litert_torch.convert`` lowers the folded model through ``torch.export`` to a ``.tflite`` flatbuffer (NHWC
inside, the NCHW input kept); the reduced-precision variants are made from that file by Google's AI Edge
Quantizer, the LiteRT quantization tool, so fp32, fp16 and int8 share one converted graph.  Parity (fp32) and
accuracy (fp16, int8, by test score against fp32 with ``export.max_accuracy_drop``) go through the LiteRT
interpreter with XNNPACK, the CPU path a phone runs.  Files are converted at batch 1, as apps run them.  An int8
file that misses the gate is quantized again with its most sensitive layers' ops left float (export/fallback.py,
:func:`module_scope` names them in the quantizer's terms).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from pydantic import Field

from vfm_toolchain.core.files import atomic_write
from vfm_toolchain.export.formats.base import (EDGE_INSTALL, ExportInputs, ExportResult, FormatOptions, Int8FormatOptions,
                                               register_format)
from vfm_toolchain.students.fold import nms_outside

__all__ = ["export_tflite", "export_tflite_fp16", "export_tflite_int8", "module_scope", "tensor_names"]


def _convert(model: torch.nn.Module, example: torch.Tensor) -> Tuple[bytes, dict]:
    """The fp32 flatbuffer and what its record adds: a detector's file holds its candidates (``nms_outside``: no NMS
    op in LiteRT's builtins that matches ours, so the runtime layer's NMS finishes it)."""
    import litert_torch

    model, detection = nms_outside(model)
    return bytes(litert_torch.convert(model.eval(), (example[:1],)).model_content()), detection


def _result(path: Path, meta) -> ExportResult:
    from vfm_toolchain.export.runtimes.litert_runtime import load as load_litert  # parity runs what is timed

    return ExportResult(path, {**meta, "batch": 1}, runner=load_litert(path, runtime_nms=meta.get("runtime_nms")))


def _quantize(fp32: bytes, recipe, path: Path, calibration=None) -> None:
    """AI Edge Quantizer on the fp32 flatbuffer, with the calibration images fed to its default signature."""
    from ai_edge_litert.interpreter import Interpreter
    from ai_edge_quantizer import quantizer

    q = quantizer.Quantizer(fp32, recipe)
    result = None
    if calibration is not None:
        signatures = Interpreter(model_content=fp32).get_signature_list()
        (name, io), = signatures.items()
        (arg,) = io["inputs"]
        result = q.calibrate({name: [{arg: np.ascontiguousarray(image[None], dtype=np.float32)}
                                     for image in calibration]}, num_threads=torch.get_num_threads())
    quantized = q.quantize(result, enable_progress_report=False).quantized_model
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(bytes(quantized)))


_NEEDS = ("litert_torch", "ai_edge_litert")


@register_format("tflite", runtime="litert", requires=_NEEDS, install=EDGE_INSTALL, targets=("android",),
                 suffix=".tflite",
                 devices="android / linux cpu (xnnpack), gpu delegate")
def export_tflite(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                  inputs: ExportInputs) -> ExportResult:
    path, t0 = Path(out_dir) / "model.tflite", time.time()
    flat, detection = _convert(model, example)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(flat))
    return _result(path, {"precision": "fp32", "seconds": round(time.time() - t0, 2), **detection})


@register_format("tflite_fp16", runtime="litert", requires=(*_NEEDS, "ai_edge_quantizer"), install=EDGE_INSTALL, 
                 targets=("android",), suffix=".fp16.tflite", precision="fp16",
                 devices="android gpu delegate (fp16 native); cpu computes in fp32")
def export_tflite_fp16(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                       inputs: ExportInputs) -> ExportResult:
    from ai_edge_quantizer import recipe_manager
    from ai_edge_quantizer.algorithm_manager import AlgorithmName
    from ai_edge_quantizer.qtyping import TFLOperationName

    path, t0 = Path(out_dir) / "model.fp16.tflite", time.time()
    recipe = recipe_manager.RecipeManager()
    recipe.add_weight_only_config(regex=".*", operation_name=TFLOperationName.ALL_SUPPORTED, num_bits=16,
                                  algorithm_key=AlgorithmName.FLOAT_CASTING)
    flat, detection = _convert(model, example)
    _quantize(flat, recipe.get_quantization_recipe(), path)
    return _result(path, {"precision": "fp16", "seconds": round(time.time() - t0, 2), **detection})


class LiteRTInt8Options(Int8FormatOptions):
    per_channel: bool = Field(True, description="int8 weights with one scale per output channel")
    float_output: bool = Field(True, description="the output layer (classifier / segmentation logits) computes and "
                                                 "returns float; false: integer end to end, for NPUs that need it")


@register_format("tflite_int8", options=LiteRTInt8Options, runtime="litert",
                 requires=(*_NEEDS, "ai_edge_quantizer"), install=EDGE_INSTALL, targets=("android",),
                 suffix=".int8.tflite",
                 precision="int8", devices="android / linux arm cpu (xnnpack int8), npu delegates")
def export_tflite_int8(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: LiteRTInt8Options,
                       inputs: ExportInputs) -> ExportResult:
    path, t0 = Path(out_dir) / "model.int8.tflite", time.time()
    calib = inputs.need_calibration("tflite_int8")
    net, (flat, detection) = model, _convert(model, example)
    post = _postprocess_scope(net, flat) if detection else None
    float_ops = _quantize_int8(flat, options, [], path, calib, post)
    meta = {"precision": "int8", "calibration_images": int(len(calib)), "per_channel": options.per_channel,
            "float_ops": float_ops, **detection}
    res = _result(path, meta)
    if inputs.judge is not None:  # judged here, so that a miss can be repaired
        res.accuracy = inputs.judge(res.runner)
        if not res.accuracy["passed"] and options.fallback:
            res.runner, res.accuracy, res.meta["fallback"] = _fall_back(net, flat, options, path, calib, inputs,
                                                                        (res.runner, res.accuracy), example, detection,
                                                                        post)
    res.meta["seconds"] = round(time.time() - t0, 2)
    return res


def _postprocess_scope(net: torch.nn.Module, flat: bytes) -> str:
    """The regex of a detector's ops left float: its decoding, the ops its candidates wrapper runs itself (the
    detector's methods, box distances in pixels included: ``FCOSHead.distances``), named after the root alone
    (``vfm_toolchain.blocks.detection.DetectorCandidates;57``; a submodule's ops carry ``/`` after it); and its
    head, whose per-tensor int8 activations (one tower shared by three levels, GroupNorm between its convs) cost
    more than the fallback can win back layer by layer.  On the Aquarium student (40 test images): fp32 29.9% mAP50;
    int8 with only the decoding float 26.4%, with every weighted layer float too (the fallback's last step) 28.1%,
    with the head float 29.2%."""
    root = nms_outside(net)[0]
    head = module_scope(root, "detector.head", tensor_names(flat))[:-1]
    return "^" + re.escape(f"{type(root).__module__}.{type(root).__qualname__}") + ";|" + head + "[/;]"


def _quantize_int8(flat: bytes, options: LiteRTInt8Options, float_scopes: List[str], path: Path, calib,
                   postprocess: Optional[str] = None) -> List[str]:
    """Static int8 of the fp32 flatbuffer into ``path``, with the ops whose output names match ``float_scopes``
    (regexes, :func:`module_scope`) left in float, and a detector's decoding (``postprocess``, every op it matches,
    and the concatenation that returns the candidates: boxes in pixels and scores in [0, 1] share no int8 scale) in
    float as in onnx_int8 (onnx_quantized_format.postprocess_nodes says why); returns the output layer's op names
    kept float."""
    from ai_edge_quantizer import recipe_manager
    from ai_edge_quantizer.algorithm_manager import AlgorithmName
    from ai_edge_quantizer.qtyping import QuantGranularity, TFLOperationName

    recipe = recipe_manager.RecipeManager()
    recipe.add_static_config(regex=".*", operation_name=TFLOperationName.ALL_SUPPORTED, activation_num_bits=8,
                             weight_num_bits=8, weight_granularity=QuantGranularity.CHANNELWISE
                             if options.per_channel else QuantGranularity.TENSORWISE)
    float_ops = []
    if options.float_output:
        # int8 logits flip near-tied classes: FastViT-T8 on CIFAR-10 lost 2.35 points of top-1 fully integer and
        # none with its classifier in float (docs/results.md); the output layer is one matmul or 1x1 conv, cheap in float
        for op_name, scope in _output_layer(flat):
            if op_name in TFLOperationName.__members__:  # later configs override earlier ones for their scope
                recipe.add_quantization_config(regex="^" + re.escape(scope), operation_name=TFLOperationName[op_name],
                                               algorithm_key=AlgorithmName.NO_QUANTIZE)
                float_ops.append(op_name)
        recipe.add_quantization_config(regex=".*", operation_name=TFLOperationName.OUTPUT,
                                       algorithm_key=AlgorithmName.NO_QUANTIZE)
    if postprocess is not None:
        recipe.add_quantization_config(regex=postprocess, operation_name=TFLOperationName.ALL_SUPPORTED,
                                       algorithm_key=AlgorithmName.NO_QUANTIZE)
        for op_name, scope in _output_layer(flat)[:1]:
            if op_name in TFLOperationName.__members__:
                recipe.add_quantization_config(regex="^" + re.escape(scope), operation_name=TFLOperationName[op_name],
                                               algorithm_key=AlgorithmName.NO_QUANTIZE)
    for scope in float_scopes:  # the accuracy fallback's layers: every weighted op the module's scope names
        for op_name in _WEIGHTED:
            if op_name in TFLOperationName.__members__:
                recipe.add_quantization_config(regex=scope, operation_name=TFLOperationName[op_name],
                                               algorithm_key=AlgorithmName.NO_QUANTIZE)
    _quantize(flat, recipe.get_quantization_recipe(), path, calib)
    return float_ops


def module_scope(model: torch.nn.Module, name: str, names: Optional[str] = None) -> str:
    """The regex that matches the output tensor names LiteRT's converter gives a module's ops: one part per module
    from the root, ``<class module>.<class qualname>`` then ``_<attribute>`` below the root, joined by ``/``, and a
    ``;`` after the module's own ops (``__main__.Net/torch.nn.modules.conv.Conv2d_stem;1``).  Only modules that were
    called get a part: a detector's candidates wrapper calls the detector's methods, not the detector, so with
    ``names`` (the file's tensor names, one text) a part that no name carries is left out."""
    kind = lambda m: f"{type(m).__module__}.{type(m).__qualname__}"
    parts, module = [kind(model)], model
    for attr in name.split("."):
        module = getattr(module, attr)
        part = f"{kind(module)}_{attr}"
        if names is None or "/".join([*parts, part]) in names or attr == name.rsplit(".", 1)[-1]:
            parts.append(part)
    return re.escape("/".join(parts)) + ";"


def tensor_names(flat: bytes) -> str:
    """Every tensor name of a flatbuffer, one per line: what :func:`module_scope` checks its parts against."""
    from ai_edge_litert.interpreter import Interpreter

    return "\n".join(t["name"] for t in Interpreter(model_content=flat).get_tensor_details())


def _fall_back(net, flat: bytes, options: LiteRTInt8Options, path: Path, calib, inputs: ExportInputs, ptq, example,
               detection, post: Optional[str]):
    """export/fallback.py on LiteRT: the file requantized with its most sensitive layers' ops in float (the AI Edge
    Quantizer's NO_QUANTIZE for their scopes), timed against the fp32 file; ``post`` is the detector's decoding
    scope the plain int8 file kept float."""
    import tempfile

    from vfm_toolchain.export.fallback import fall_back
    from vfm_toolchain.export.runtimes.litert_runtime import load as load_litert

    converted = nms_outside(net)[0]  # the module tree the flatbuffer's names come from
    names = tensor_names(flat)
    nms = detection.get("runtime_nms")

    def make(layers: List[str]):
        _quantize_int8(flat, options, [module_scope(converted, n, names) for n in layers], path, calib, post)
        return load_litert(path, runtime_nms=nms)

    with tempfile.TemporaryDirectory(prefix="litert_fp32_") as tmp:
        fp32 = Path(tmp) / "model.tflite"
        fp32.write_bytes(flat)
        ranked, producers = inputs.fallback_plan(net, example[:1], "tflite_int8")
        runner, record = fall_back("tflite_int8", ranked, make, inputs.judge, ptq, load_litert(fp32, runtime_nms=nms),
                                   example[:1].numpy(), inputs.say, producers)
    return runner, record["verdict"], record


_WEIGHTED = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV"}


def _output_layer(flat: bytes) -> List[Tuple[str, str]]:
    """``(op name, quantizer scope)`` of the ops from the model's output back to the last layer with weights, that
    layer included (a classifier's matmul; a segmentation head's 1x1 conv and the resize after it).  The AI Edge
    Quantizer matches a scope regex against an op's output tensor names joined by ``;``, with a trailing ``;``."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=flat)
    names = {t["index"]: t["name"] for t in interpreter.get_tensor_details()}
    producer = {out: op for op in interpreter._get_ops_details() for out in op["outputs"]}
    op, chain = producer.get(interpreter.get_output_details()[0]["index"]), []
    while op is not None:
        chain.append((op["op_name"], ";".join(names[i] for i in op["outputs"]) + ";"))
        if op["op_name"] in _WEIGHTED or len(op["inputs"]) == 0:
            break
        op = producer.get(op["inputs"][0])
    return chain
