"""Core ML ``.mlpackage`` (ML program) through coremltools; prediction, hence parity, needs macOS."""
from __future__ import annotations

import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from export.formats.base import FORMATS, ExportResult, Skipped


@FORMATS.register("coreml", suffix=".mlpackage", devices="apple (cpu, gpu, neural engine)",
                  options=["precision", "deployment_target", "metadata"])
def export_coreml(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, opts: Dict[str, Any]) -> ExportResult:
    try:
        import coremltools as ct
    except ImportError as exc:
        raise Skipped(f"coremltools is not importable ({exc}); pip install coremltools") from None
    t0 = time.time()
    traced = torch.jit.trace(model, example[:1])
    precision = ct.precision.FLOAT16 if opts.get("precision") == "fp16" else ct.precision.FLOAT32
    target = getattr(ct.target, opts.get("deployment_target", "iOS16"))
    mlmodel = ct.convert(traced, inputs=[ct.TensorType(name="input", shape=tuple(example[:1].shape))],
                         convert_to="mlprogram", compute_precision=precision, minimum_deployment_target=target)
    md = opts.get("metadata") or {}
    mlmodel.short_description = "vfm-toolchain export"
    for k, v in md.items():
        mlmodel.user_defined_metadata[k] = v if isinstance(v, str) else str(v)
    path = Path(out_dir) / "model.mlpackage"
    tmp = Path(out_dir) / ".tmp-model.mlpackage"
    shutil.rmtree(tmp, ignore_errors=True)
    mlmodel.save(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)  # a directory: written whole, then renamed into place
    meta = {"seconds": round(time.time() - t0, 2), "precision": "fp16" if precision == ct.precision.FLOAT16 else "fp32",
            "deployment_target": opts.get("deployment_target", "iOS16"), "compute_units": "ALL"}
    if platform.system() != "Darwin":
        return ExportResult(path, meta, parity_skipped="Core ML prediction needs macOS; parity runs there")

    def run(x: np.ndarray) -> np.ndarray:
        out = mlmodel.predict({"input": x})
        return np.asarray(next(iter(out.values())))

    return ExportResult(path, meta, runner=run)
