"""ExecuTorch (Android, iOS, embedded Linux): ``executorch`` (fp32) and ``executorch_int8`` ``.pte`` programs.

The folded model goes through ``torch.export`` and ``to_edge_transform_and_lower`` with the recipe's
partitioners, in order of preference: each claims the subgraphs its backend runs and the next takes the
rest, so ``[coreml, xnnpack]`` runs on the Apple Neural Engine where it can and on the CPU elsewhere.
XNNPACK, the CPU backend, is the one every phone has and the one this machine runs: the artifact is
checked here through ``executorch.runtime``, with the same kernels a phone uses (x86 builds of them).

``executorch_int8`` is PT2E static quantization with the XNNPACK quantizer (int8 weights, per channel by
default, int8 activations calibrated on transfer-set images), then lowered the same way; the stage judges it
by test accuracy against fp32 (``export.max_accuracy_drop``); one that misses it is rebuilt with its most sensitive
layers in ``float_modules`` (export/fallback.py).

A detector's program returns its candidates (every location's decoded box and class scores, students/fold.py
``nms_outside``): an ExecuTorch program holds no NMS op, so the runtime layer's NMS (export/runtimes/nms.py, the one
parity, the bench and the device bundle run, which an app ports) finishes it with the settings in its record.

Programs are exported at batch 1, the batch a phone app runs: MobileViT's unfold reshapes fix the batch
in XNNPACK's memory plan (a dynamic batch fails at run time with "Attempted to resize a static tensor"),
so the runner here feeds larger batches one image at a time.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Literal, Optional

import numpy as np
import torch
from pydantic import Field

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write
from vfm_toolchain.export.formats.base import (EDGE_INSTALL, ExportInputs, ExportResult, FormatOptions, Int8FormatOptions,
                                               Skipped, register_format)
from vfm_toolchain.students.fold import nms_outside

__all__ = ["export_executorch", "export_executorch_int8", "PARTITIONERS"]

Partitioner = Literal["xnnpack", "coreml", "vulkan", "qnn"]


def _xnnpack(options):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner()


def _coreml(options):
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    return CoreMLPartitioner()


def _vulkan(options):
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    return VulkanPartitioner()


def _qnn(options):
    # the QNN backend compiles for one Snapdragon SoC with Qualcomm's AI Engine Direct SDK, which is not on PyPI
    if not os.environ.get("QNN_SDK_ROOT"):
        raise Skipped("the qnn partitioner needs Qualcomm's AI Engine Direct SDK: set QNN_SDK_ROOT to it "
                      "(https://www.qualcomm.com/developer/software/qualcomm-ai-engine-direct-sdk)")
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import (generate_htp_compiler_spec,
                                                          generate_qnn_executorch_compiler_spec,
                                                          get_soc_to_chipset_map)

    socs = get_soc_to_chipset_map()
    if options.qnn_soc not in socs:
        raise ToolchainError(f"export.options: qnn_soc {options.qnn_soc!r} is not a chipset ExecuTorch knows; "
                             f"choose one of {sorted(socs)}")
    return QnnPartitioner(generate_qnn_executorch_compiler_spec(
        soc_model=socs[options.qnn_soc], backend_options=generate_htp_compiler_spec(use_fp16=True)))


# name -> builder(options); what runs each backend's subgraphs on a device
PARTITIONERS: Dict[str, Callable] = {"xnnpack": _xnnpack, "coreml": _coreml, "vulkan": _vulkan, "qnn": _qnn}


class ExecuTorchOptions(FormatOptions):
    partitioners: List[Partitioner] = Field(["xnnpack"], min_length=1,
                                            description="backends in order of preference; xnnpack (CPU) runs "
                                                        "everywhere and is the one checked here")
    qnn_soc: str = Field("SM8650", description="Snapdragon SoC the qnn partitioner compiles for")


class ExecuTorchInt8Options(ExecuTorchOptions, Int8FormatOptions):
    per_channel: bool = Field(True, description="int8 weights with one scale per output channel")
    float_modules: List[str] = Field([], description="module names kept in float (fnmatch patterns over the "
                                                     "exported model's module names, e.g. 'detector.backbone."
                                                     "stages_1.*'): the XNNPACK quantizer's per-module "
                                                     "configuration; everything else is int8")


def _lower(program, options: ExecuTorchOptions, path: Path) -> List[str]:
    """Lower an exported program with the recipe's partitioners and write the ``.pte`` atomically; returns the
    backends that claimed part of the graph."""
    from executorch.exir import to_edge_transform_and_lower

    partitioners = [PARTITIONERS[name](options) for name in options.partitioners]
    edge = to_edge_transform_and_lower(program, partitioner=partitioners)
    delegates = sorted({sub.backend_id for sub in _lowered(edge)})
    buffer = edge.to_executorch().buffer
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(buffer))
    return delegates


def _lowered(edge):
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    return [sub for _, sub, _ in get_lowered_submodules(edge.exported_program().graph_module)]


def _result(path: Path, options: ExecuTorchOptions, delegates: List[str], meta: Dict) -> ExportResult:
    """The artifact with a runner when this machine can run every backend in it (XNNPACK and portable ops
    can; Core ML, Vulkan and QNN subgraphs need their device); a detector's runner ends with the shared NMS."""
    from vfm_toolchain.export.runtimes.executorch_runtime import load as load_executorch  # parity runs what is timed

    meta = {**meta, "delegates": delegates, "partitioners": list(options.partitioners), "batch": 1}
    foreign = [d for d in delegates if d != "XnnpackBackend"]
    if foreign:
        return ExportResult(path, meta, parity_skipped=f"{', '.join(foreign)} subgraphs run only on their device")
    return ExportResult(path, meta, runner=load_executorch(path, runtime_nms=meta.get("runtime_nms")))


@register_format("executorch", options=ExecuTorchOptions, runtime="executorch", requires=("executorch",),
                 install=EDGE_INSTALL, targets=("android",), suffix=".pte",
                 devices="android / ios / linux cpu (xnnpack); ane, gpu, npu through partitioners")
def export_executorch(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: ExecuTorchOptions,
                      inputs: ExportInputs) -> ExportResult:
    path, t0 = Path(out_dir) / "model.pte", time.time()
    model, detection = nms_outside(model)  # a detector: its candidates, NMS in the runtime layer
    program = torch.export.export(model.eval(), (example[:1],))
    delegates = _lower(program, options, path)
    return _result(path, options, delegates, {"precision": "fp32", "seconds": round(time.time() - t0, 2),
                                              **detection})


@register_format("executorch_int8", options=ExecuTorchInt8Options, runtime="executorch",
                 requires=("executorch", "torchao"), install=EDGE_INSTALL, targets=("android",), suffix=".int8.pte",
                 precision="int8", devices="android / linux arm cpu (xnnpack int8)")
def export_executorch_int8(model: torch.nn.Module, example: torch.Tensor, out_dir: Path,
                           options: ExecuTorchInt8Options, inputs: ExportInputs) -> ExportResult:
    path, t0 = Path(out_dir) / "model.int8.pte", time.time()
    net, (model, detection) = model, nms_outside(model)
    calib = inputs.need_calibration("executorch_int8")
    keep, why = list(options.float_modules), None
    delegates = _quantize_and_lower(model, example[:1], calib, options, keep, path)
    failure = _fails_here(path, delegates, example[:1].shape)
    if failure and detection and not keep:
        # XNNPACK (ExecuTorch 1.5) fails at load or run time on int8 maps read twice: FastViT's quantized per-channel
        # layer scale where a stage's output feeds both the next stage and the neck, the FPN's laterals (read by
        # the upsampling and the smoothing), the head's convs (one weight for the three levels).  Retried with
        # fewer layers int8, the first that runs is kept and the record says why.
        first = failure
        fan_out = _fan_out_layers(model)
        for keep, kept in ((fan_out, "the last layer of each feature map both the next stage and the neck read"),
                           ([*fan_out, "detector.neck", "detector.head"],
                            "those layers, the neck and the head: the backbone alone is int8")):
            delegates = _quantize_and_lower(model, example[:1], calib, options, keep, path)
            failure = _fails_here(path, delegates, example[:1].shape)
            if not failure:
                why = f"XNNPACK could not run the fully int8 program here ({first}); kept in float {kept}"
                break
    if failure:
        raise ToolchainError(f"executorch_int8: XNNPACK cannot run the int8 program ({failure}); keep the failing "
                             f"layers in float with export.options.executorch_int8.float_modules (module names, "
                             f"fnmatch patterns), or drop executorch_int8")
    meta = {"precision": "int8", "calibration_images": int(len(calib)), "per_channel": options.per_channel,
            "seconds": round(time.time() - t0, 2), **detection}
    res = _result(path, options, delegates, meta)
    if res.runner is not None and inputs.judge is not None:  # judged here, so that a miss can be repaired
        res.accuracy = inputs.judge(res.runner)
        if not res.accuracy["passed"] and options.fallback:
            res.runner, res.accuracy, meta["fallback"] = _fall_back(net, model, example[:1], calib, options, keep,
                                                                    path, inputs, (res.runner, res.accuracy),
                                                                    detection)
            keep = keep + meta["fallback"]["float_layers"]
    if keep:
        meta.update(float_modules=keep, **({"float_reason": why} if why else {}))
    res.meta.update(meta)
    return res


def _fall_back(net, model, one, calib, options: ExecuTorchInt8Options, keep: List[str], path: Path,
               inputs: ExportInputs, ptq, detection: Dict):
    """export/fallback.py on ExecuTorch: the program requantized with its most sensitive layers also in
    ``float_modules`` (the XNNPACK quantizer's per-module configuration), timed against the fp32 program."""
    import tempfile

    from vfm_toolchain.export.fallback import fall_back
    from vfm_toolchain.export.runtimes.executorch_runtime import load as load_executorch

    nms = detection.get("runtime_nms")

    def make(layers: List[str]):
        delegates = _quantize_and_lower(model, one, calib, options, [*keep, *layers], path)
        failure = _fails_here(path, delegates, one.shape)
        if failure:
            raise ToolchainError(f"executorch_int8: with {len(layers)} layers back in float for accuracy, XNNPACK "
                                 f"cannot run the program ({failure}); set export.options.executorch_int8.fallback: "
                                 f"false, or name float_modules yourself")
        return load_executorch(path, runtime_nms=nms)

    with tempfile.TemporaryDirectory(prefix="executorch_fp32_") as tmp:
        fp32 = Path(tmp) / "model.pte"
        _lower(torch.export.export(model.eval(), (one,)), options, fp32)
        ranked, producers = inputs.fallback_plan(net, one, "executorch_int8")
        runner, record = fall_back("executorch_int8", ranked, make, inputs.judge, ptq,
                                   load_executorch(fp32, runtime_nms=nms), one.numpy(), inputs.say, producers)
    return runner, record["verdict"], record


def _quantize_and_lower(model: torch.nn.Module, one: torch.Tensor, calib, options: ExecuTorchInt8Options,
                        keep_float: List[str], path: Path) -> List[str]:
    """PT2E static int8 with the XNNPACK quantizer (every module but ``keep_float``), calibrated one image at a
    time, lowered and written to ``path``; returns the delegates."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                         get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = get_symmetric_quantization_config(is_per_channel=options.per_channel)
    detector = getattr(model, "detector", None)  # a detector's candidates: its network, never its decoding
    if detector is not None:
        # module by module over what the network calls (backbone, neck, head): the decoding the detector runs in its
        # own methods (box distances in pixels included) stays float, as in onnx_int8
        # (onnx_quantized_format.postprocess_nodes says why)
        quantizer = _scoped_quantizer(_covering(detector, keep_float, "detector"), config)
    elif keep_float:  # the quantizer takes no "float" config: name every module outside keep_float instead
        quantizer = _scoped_quantizer(_covering(model, keep_float), config)
    else:
        quantizer = XNNPACKQuantizer().set_global(config)
    graph = torch.export.export(model.eval(), (one,)).module()
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for image in calib:  # observers record activation ranges, one transfer image at a time (batch 1)
            prepared(torch.from_numpy(image[None]).float())
    return _lower(torch.export.export(convert_pt2e(prepared), (one,)), options, path)


def _scoped_quantizer(names: List[str], config):
    """An XNNPACK quantizer that quantizes the modules ``names`` and nothing outside them.

    ``XNNPACKQuantizer.set_module_name`` cannot do it (ExecuTorch 1.5): its filter must accept every node of a
    pattern, a conv's weight and bias included, and in an exported graph those carry no module stack, so no conv or
    linear is ever annotated; and its concatenation annotator ignores filters, so the shape ops after a quantized op
    share its parameters wherever they run (pytorch/pytorch#115251 is the same leak for ``set_module_type``).  On
    the Aquarium detector, module by module, that left every layer float and quantized the decoding instead: the
    candidates' last concatenation, boxes in pixels beside scores in [0, 1], got one int8 grid of 1.25-pixel steps
    and every score became 0 or 1.25 (17.0% test mAP50 on 40 images against fp32's 29.9%, whatever layers were kept
    float).  So: the global configuration, a filter that judges a node by its own module stack (weights and
    constants pass), and, after annotating, every annotation outside ``names`` dropped, with any that shares a
    dropped one's parameters, before observers are inserted."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec, get_module_name_filter

    inside = [get_module_name_filter(name) for name in names]
    in_scope = lambda n: n.op != "call_function" or any(f(n) for f in inside)  # noqa: E731
    key = "quantization_annotation"

    def owner(spec):
        """The node whose annotation holds what a shared spec points at (an edge's observer: its user's)."""
        if not isinstance(spec, SharedQuantizationSpec):
            return None
        src = spec.edge_or_node
        return src[1] if isinstance(src, tuple) else src

    def orphaned(n) -> bool:
        specs = [n.meta[key].output_qspec, *n.meta[key].input_qspec_map.values()]
        return any(o is not None and o is not n and key not in o.meta for o in map(owner, specs))

    class Scoped(XNNPACKQuantizer):
        def annotate(self, model):
            model = super().annotate(model)
            dropped = [n for n in model.graph.nodes if key in n.meta and not in_scope(n)]
            while dropped:
                for n in dropped:
                    del n.meta[key]
                dropped = [n for n in model.graph.nodes if key in n.meta and orphaned(n)]
            return model

    quantizer = Scoped().set_global(config)
    quantizer.set_filter_function(in_scope)
    return quantizer


def _covering(model: torch.nn.Module, patterns: List[str], prefix: str = "") -> List[str]:
    """The fewest module names that cover every module except those matching ``patterns`` (and what is inside
    them).  Ops a parent runs in its own forward, outside its children, stay float where a child is kept float."""
    from fnmatch import fnmatch

    names = []
    for name, child in model.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if any(fnmatch(full, p) for p in patterns):
            continue
        inside = any(any(fnmatch(f"{full}.{n}", p) for p in patterns) for n, _ in child.named_modules() if n)
        names += _covering(child, patterns, full) if inside else [full]
    return names


def _fan_out_layers(model: torch.nn.Module) -> List[str]:
    """A detector's feature maps that both the next backbone stage and the neck read (every tapped map but the
    deepest): the name of the last module with weights inside the module that writes each (timm's
    ``feature_info``); none for a backbone without it."""
    body = model.detector.backbone
    info = getattr(body, "feature_info", None)
    if info is None:
        return []
    names = []
    for tapped in info.module_name()[:-1]:
        module_name = tapped.replace(".", "_")  # FeatureListNet flattens timm's dotted names
        module = getattr(body, module_name, None)
        weighted = [n for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))] \
            if module is not None else []
        if weighted:
            names.append(f"detector.backbone.{module_name}.{weighted[-1]}")
    return names


def _fails_here(path: Path, delegates: List[str], shape) -> str:
    """Why the program does not run here on one input (XNNPACK reports it at load or at the first run), "" when it
    runs or cannot be run here at all (other backends: their device checks it)."""
    if any(d != "XnnpackBackend" for d in delegates):
        return ""
    from vfm_toolchain.export.runtimes.base import Unavailable
    from vfm_toolchain.export.runtimes.executorch_runtime import load as load_executorch

    try:
        load_executorch(path)(np.zeros(tuple(shape), dtype=np.float32))
    except (Unavailable, RuntimeError) as why:
        return str(why).splitlines()[0][:200]
    return ""

