"""Core ML ``.mlpackage`` (ML program) through coremltools; prediction, hence parity, needs macOS.

Options: ``precision`` fp32 / fp16 (compute precision of the ML program), ``image_input`` (the input is
an RGB image, 0-255: scaling to 0-1 is Core ML's ``ImageType`` scale, the per-channel mean/std
normalisation is folded into the model, so an app hands over a camera frame as it is), ``classes``
(classifiers get Core ML class labels, ``classLabel`` + ``classLabel_probs``, the latter holding the
model's logits), ``deployment_target`` and ``compute_units`` (recorded, and used by the macOS runner).

A detector becomes a pipeline: the network returns every location's class scores and box (students/fold.py
``nms_outside``, as Vision wants them: relative centre and size), and Core ML's NonMaximumSuppression model selects
the final boxes per class with the export's thresholds, on the device, as the ONNX graph's NMS does.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch

from pydantic import Field

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.export.formats.base import ExportInputs, ExportResult, FormatOptions, Skipped, register_format
from vfm_toolchain.export.runtimes.coreml_runtime import load as load_coreml
from vfm_toolchain.students.fold import nms_outside


# What a detection package returns (its NMS model's outputs); the runtime turns them into the [K, 7] rows
COREML_DETECTIONS = ("a pipeline ending in Core ML's NonMaximumSuppression model: confidence [K, C] (class scores) and "
                     "coordinates [K, 4] (x centre, y centre, width, height relative to the input), per class; "
                     "iouThreshold and confidenceThreshold inputs override the defaults in nms")


class _Normalize(torch.nn.Module):
    """0-1 RGB in, the model's normalised input out: (x - mean) / std, then the model."""

    def __init__(self, model: torch.nn.Module, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)


class _Detections(torch.nn.Module):
    """A detector's candidates for one image as Core ML's NonMaximumSuppression model reads them: ``confidence``
    (N, C) class scores and ``coordinates`` (N, 4) boxes as (x centre, y centre, width, height) relative to the
    input's width and height (what Vision expects; IoU is the same in any axis scaling)."""

    def __init__(self, candidates: torch.nn.Module, hw):
        super().__init__()
        self.candidates = candidates
        self.h, self.w = float(hw[0]), float(hw[1])

    def forward(self, x: torch.Tensor):
        c = self.candidates(x)[0]
        x1, y1, x2, y2 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
        coordinates = torch.stack([(x1 + x2) / (2 * self.w), (y1 + y2) / (2 * self.h), (x2 - x1) / self.w,
                                   (y2 - y1) / self.h], dim=1)
        return c[:, 4:], coordinates


def _with_nms(ct, network, classes, nms):
    """The network followed by Core ML's NonMaximumSuppression model in one pipeline (per class, the export's IoU
    and score thresholds as defaults an app may override through the ``iouThreshold`` and ``confidenceThreshold``
    inputs): the on-device form of the graphs that hold NMS."""
    spec = network.get_spec()
    nms_spec = ct.proto.Model_pb2.Model()
    nms_spec.specificationVersion = 5
    for i, name in enumerate(("confidence", "coordinates")):
        described = next(o for o in spec.description.output if o.name == name).SerializeToString()
        nms_spec.description.input.add().ParseFromString(described)
        out = nms_spec.description.output.add()
        out.ParseFromString(described)
        array = out.type.multiArrayType  # any number of boxes, each with C scores or 4 coordinates
        del array.shape[:]
        for lower, upper in ((0, -1), ((len(classes), 4)[i], (len(classes), 4)[i])):
            size = array.shapeRange.sizeRanges.add()
            size.lowerBound, size.upperBound = lower, upper
    suppress = nms_spec.nonMaximumSuppression
    suppress.confidenceInputFeatureName = suppress.confidenceOutputFeatureName = "confidence"
    suppress.coordinatesInputFeatureName = suppress.coordinatesOutputFeatureName = "coordinates"
    suppress.iouThresholdInputFeatureName = "iouThreshold"
    suppress.confidenceThresholdInputFeatureName = "confidenceThreshold"
    suppress.iouThreshold = float(nms["iou"])
    suppress.confidenceThreshold = float(nms["score_thresh"])
    suppress.pickTop.perClass = True  # class-aware, as the other formats' NMS
    suppress.stringClassLabels.vector.extend([str(c) for c in classes])
    nms_model = ct.models.MLModel(nms_spec)
    image = spec.description.input[0]
    pipeline = ct.models.pipeline.Pipeline(
        input_features=[("input", ct.models.datatypes.Array(1)), ("iouThreshold", ct.models.datatypes.Double()),
                        ("confidenceThreshold", ct.models.datatypes.Double())],
        output_features=["confidence", "coordinates"])
    pipeline.add_model(network)
    pipeline.add_model(nms_model)
    pipeline.spec.description.input[0].ParseFromString(image.SerializeToString())
    for i in range(2):
        pipeline.spec.description.output[i].ParseFromString(nms_model.get_spec().description.output[i]
                                                            .SerializeToString())
    pipeline.spec.specificationVersion = max(spec.specificationVersion, 5)  # an ML program needs its own version
    return ct.models.MLModel(pipeline.spec, weights_dir=network.weights_dir)


class CoreMLOptions(FormatOptions):
    precision: Literal["fp32", "fp16"] = Field("fp32", description="compute precision of the ML program")
    image_input: bool = Field(True, description="the input is an RGB image (0-255) with the normalisation inside "
                                                "the model, so an app hands over a camera frame as it is")
    target: str = Field("iOS16", description="minimum deployment target (coremltools name: iOS16, iOS17, macOS13)")
    compute_units: Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = "ALL"
    parity_atol: Optional[float] = Field(0.05, gt=0, description="parity tolerance on macOS: an image input is "
                                         "rounded to 8 bits, and fp16 computes in half precision")


@register_format("coreml", options=CoreMLOptions, runtime="coreml", targets=("ios",), suffix=".mlpackage",
                 devices="apple (cpu, gpu, neural engine)", precision="options.precision")
def export_coreml(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: CoreMLOptions,
                  inputs: ExportInputs) -> ExportResult:
    try:
        import coremltools as ct
    except ImportError as exc:
        raise Skipped(f"coremltools is not importable ({exc}); pip install coremltools") from None
    t0 = time.time()
    pp = inputs.preprocess
    image_input = options.image_input and pp is not None
    shape = tuple(example[:1].shape)
    model, detection = nms_outside(model)  # a detector: its candidates, then Core ML's own NMS model
    outputs_ct = None
    if detection:
        model = _Detections(model, shape[-2:]).eval()
        outputs_ct = [ct.TensorType(name="confidence"), ct.TensorType(name="coordinates")]
    if image_input:
        traced = torch.jit.trace(_Normalize(model, pp["mean"], pp["std"]).eval(), torch.rand(shape))
        inputs_ct = [ct.ImageType(name="input", shape=shape, scale=1 / 255.0, color_layout=ct.colorlayout.RGB)]
    else:
        traced = torch.jit.trace(model, example[:1])
        inputs_ct = [ct.TensorType(name="input", shape=shape)]
    precision, target_name, units_name = options.precision, options.target, options.compute_units
    target = getattr(ct.target, target_name, None)
    if target is None:
        raise ToolchainError(f"export.options.coreml.target '{target_name}' is unknown to coremltools "
                             f"{ct.__version__}; use e.g. iOS16, iOS17, macOS13")
    classes = inputs.classes
    classifier = ct.ClassifierConfig(list(classes)) if classes else None
    mlmodel = ct.convert(traced, inputs=inputs_ct, outputs=outputs_ct, convert_to="mlprogram",
                         classifier_config=classifier,
                         compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
                         minimum_deployment_target=target, compute_units=getattr(ct.ComputeUnit, units_name))
    if detection:
        mlmodel = _with_nms(ct, mlmodel, inputs.metadata.get("classes") or [], detection["runtime_nms"])
    # what this package takes and returns, for the record and, where it differs from the build's metadata (an
    # image, not the normalised tensor; the NMS model's outputs, not [K, 7] rows), for the file
    contract = {"input": "image (RGB 0-255, normalisation inside)" if image_input else "tensor (normalised)",
                **({"output": COREML_DETECTIONS, "nms": detection["runtime_nms"]} if detection else {})}
    md = {**inputs.metadata, **{k: v for k, v in contract.items() if k != "input" or image_input}}
    mlmodel.short_description = "vfm-toolchain export"
    for k, v in md.items():
        mlmodel.user_defined_metadata[k] = v if isinstance(v, str) else json.dumps(v)
    # read back by the Core ML runtime (export/runtimes/coreml_runtime.py), here and in a device bundle
    mlmodel.user_defined_metadata["class_labels"] = "true" if classes else "false"
    mlmodel.user_defined_metadata["precision"] = precision
    path = Path(out_dir) / "model.mlpackage"
    tmp = Path(out_dir) / ".tmp-model.mlpackage"
    shutil.rmtree(tmp, ignore_errors=True)
    mlmodel.save(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a directory: written whole, then renamed into place
    meta = {"seconds": round(time.time() - t0, 2), "precision": precision, "deployment_target": target_name,
            "compute_units": units_name, "class_labels": bool(classes), **contract}
    if platform.system() != "Darwin":
        return ExportResult(path, meta, parity_skipped="Core ML prediction needs macOS; parity runs there")
    # parity runs through the runtime that times it and that the device bundle carries
    return ExportResult(path, meta, runner=load_coreml(path, compute_units=units_name))
