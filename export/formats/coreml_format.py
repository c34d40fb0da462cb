"""Core ML ``.mlpackage`` (ML program) through coremltools; prediction, hence parity, needs macOS.

Options: ``precision`` fp32 / fp16 (compute precision of the ML program), ``image_input`` (the input is
an RGB image, 0-255: scaling to 0-1 is Core ML's ``ImageType`` scale, the per-channel mean/std
normalisation is folded into the model, so an app hands over a camera frame as it is), ``classes``
(classifiers get Core ML class labels, ``classLabel`` + ``classLabel_probs``, the latter holding the
model's logits), ``deployment_target`` and ``compute_units`` (recorded, and used by the macOS runner).
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

from vfm_toolchain.export.formats.base import ExportInputs, ExportResult, FormatOptions, Skipped, register_format
from vfm_toolchain.export.runtimes.coreml_runtime import load as load_coreml
from vfm_toolchain.errors import ToolchainError


class _Normalize(torch.nn.Module):
    """0-1 RGB in, the model's normalised input out: (x - mean) / std, then the model."""

    def __init__(self, model: torch.nn.Module, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)


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
    mlmodel = ct.convert(traced, inputs=inputs_ct, convert_to="mlprogram", classifier_config=classifier,
                         compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
                         minimum_deployment_target=target, compute_units=getattr(ct.ComputeUnit, units_name))
    md = inputs.metadata
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
            "compute_units": units_name, "input": "image (RGB 0-255, normalisation inside)" if image_input
            else "tensor (normalised)", "class_labels": bool(classes)}
    if platform.system() != "Darwin":
        return ExportResult(path, meta, parity_skipped="Core ML prediction needs macOS; parity runs there")
    # parity runs through the runtime that times it and that the device bundle carries
    return ExportResult(path, meta, runner=load_coreml(path, compute_units=units_name))
