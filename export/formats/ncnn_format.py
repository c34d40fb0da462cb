"""NCNN (Tencent's inference library, the CPU runtime many Android apps ship): ``ncnn`` (fp32) and ``ncnn_fp16``, a
``.ncnn.param`` graph with its ``.ncnn.bin`` weights beside it.

pnnx, ncnn's own PyTorch converter, converts the folded model traced by TorchScript at batch 1 (ncnn's blobs have no
batch axis; the runtime runs a batch one image after another).  The pnnx wheel ships the ``pnnx`` executable itself
(``pnnx.EXEC_PATH``): nothing is downloaded, here or at first use.  It is called directly rather than through
``pnnx.export``, which ignores the executable's exit status and imports the Python file it generates.
``torch.jit.trace`` warns that it is deprecated (PyTorch 2.14); it still traces, and TorchScript is what pnnx reads.

- ``ncnn``: fp32 weights (pnnx ``fp16=0``), run with ncnn's fp16 and bf16 options off: checked by parity against
  PyTorch.
- ``ncnn_fp16``: fp16 weights (pnnx ``fp16=1``, its default: half the ``.bin``), run with ncnn's fp16 storage, packing
  and arithmetic on (ncnn's defaults, what an app gets): fp16 activations and arithmetic on CPUs with fp16 arithmetic
  (ARMv8.2 ``asimdhp``, most phones since 2018), fp32 arithmetic from the fp16 weights elsewhere (x86).  Judged by
  test accuracy against fp32 (``export.max_accuracy_drop``), as every reduced-precision format is.

No int8 format: ncnn quantizes with its ``ncnn2table`` (activation scales from calibration images) and ``ncnn2int8``
(the rewrite of the ``.param``/``.bin``) tools, which neither the ncnn nor the pnnx wheel ships, nor the ncnn sdist on
PyPI (``src/`` and ``python/``, no ``tools/``); pnnx itself has no int8 option.

A detector is exported as its candidates (``nms_outside``) and finished by the runtime layer's NMS, as LiteRT and
ExecuTorch are.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.export.formats.base import EDGE_INSTALL, ExportInputs, ExportResult, FormatOptions, register_format
from vfm_toolchain.export.runtimes.ncnn_runtime import unknown_layers, weights_file
from vfm_toolchain.students.fold import nms_outside

__all__ = ["export_ncnn", "export_ncnn_fp16"]

_NEEDS = ("pnnx", "ncnn")


def _convert(model: torch.nn.Module, example: torch.Tensor, path: Path, fp16: bool) -> dict:
    """``path`` (the ``.param``) and its ``.bin`` from pnnx; what the record adds (a detector's candidates)."""
    import pnnx

    model, detection = nms_outside(model)
    with tempfile.TemporaryDirectory(prefix=".pnnx_", dir=path.parent) as tmp:  # beside path: the renames are atomic
        tmp = Path(tmp)
        with torch.no_grad():
            torch.jit.trace(model.eval(), example[:1]).save(str(tmp / "model.pt"))
        shape = ",".join(str(d) for d in example[:1].shape)
        param, weights = tmp / "model.ncnn.param", tmp / "model.ncnn.bin"
        outputs = {"ncnnparam": param, "ncnnbin": weights, "ncnnpy": tmp / "model_ncnn.py", "pnnxparam":
                   tmp / "model.pnnx.param", "pnnxbin": tmp / "model.pnnx.bin", "pnnxpy": tmp / "model_pnnx.py",
                   "pnnxonnx": tmp / "model.pnnx.onnx"}
        done = subprocess.run([pnnx.EXEC_PATH, str(tmp / "model.pt"), f"inputshape=[{shape}]f32", "device=cpu",
                               f"fp16={int(fp16)}", *(f"{k}={v}" for k, v in outputs.items())],
                              cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0 or not param.is_file() or not weights.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise ToolchainError(f"pnnx could not convert {type(model).__name__} to ncnn (exit {done.returncode}):\n"
                                 f"{tail}")
        missing = unknown_layers(param)
        if missing:
            raise ToolchainError(f"pnnx converted {type(model).__name__} with ops ncnn has no layer for: "
                                 f"{', '.join(missing)}; leave ncnn and ncnn_fp16 out of export.formats for this model")
        os.replace(weights, weights_file(path))  # the .bin first, the .param (what loads) last
        os.replace(param, path)
    return detection


def _export(model: torch.nn.Module, example: torch.Tensor, path: Path, precision: str) -> ExportResult:
    from vfm_toolchain.export.runtimes.ncnn_runtime import load as load_ncnn  # parity runs what is timed

    t0 = time.time()
    detection = _convert(model, example, path, fp16=precision == "fp16")
    meta = {"precision": precision, "batch": 1, "seconds": round(time.time() - t0, 2), **detection}
    return ExportResult(path, meta, runner=load_ncnn(path, precision=precision,
                                                      runtime_nms=detection.get("runtime_nms")))


@register_format("ncnn", runtime="ncnn", requires=_NEEDS, install=EDGE_INSTALL, targets=("android",),
                 suffix=".ncnn.param (+ .bin)", devices="android / linux arm and x86 cpu, vulkan gpu")
def export_ncnn(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                inputs: ExportInputs) -> ExportResult:
    return _export(model, example, Path(out_dir) / "model.ncnn.param", "fp32")


@register_format("ncnn_fp16", runtime="ncnn", requires=_NEEDS, install=EDGE_INSTALL, targets=("android",),
                 suffix=".fp16.ncnn.param (+ .bin)", precision="fp16",
                 devices="android / linux arm cpu (fp16 arithmetic on armv8.2), vulkan gpu; x86 computes in fp32")
def export_ncnn_fp16(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: FormatOptions,
                     inputs: ExportInputs) -> ExportResult:
    return _export(model, example, Path(out_dir) / "model.fp16.ncnn.param", "fp16")
