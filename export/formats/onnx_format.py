"""ONNX: dynamic batch (and optionally height and width), opset verified in the written file, onnxslim
clean-up, metadata in the model, weights in an external data file when large (protobuf caps a single
file at 2 GB; runtimes read ``model.onnx`` and ``model.onnx.data`` side by side)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from pydantic import Field

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write
from vfm_toolchain.export.formats.base import ExportInputs, ExportResult, FormatOptions, register_format
from vfm_toolchain.export.runtimes.onnxruntime_runtime import load as load_onnxruntime
from vfm_toolchain.students.fold import holds_nms


class OnnxOptions(FormatOptions):
    opset: int = Field(17, ge=11, description="ONNX opset, verified in the written file")
    slim: bool = Field(True, description="onnxslim graph clean-up")
    dynamic_size: bool = Field(False, description="input height and width are free (checked by running a second "
                                                  "size through the file); batch is always free")
    external_data_mb: float = Field(1024, ge=0, description="weights go to model.onnx.data when they exceed this "
                                                            "(protobuf caps one file at 2 GB)")


# ONNX Runtime is not a base dependency: its CPU and GPU builds (onnxruntime / onnxruntime-gpu) install the same
# module and cannot sit side by side, so each install names one through an extra
ORT_INSTALL = "pip install 'vfm-toolchain[cpu]' (or 'vfm-toolchain[gpu]' on a CUDA 13 machine)"


@register_format("onnx", options=OnnxOptions, runtime="onnxruntime", requires=("onnxruntime",), install=ORT_INSTALL,
                 targets=("cpu", "x86", "nvidia"), suffix=".onnx", devices="cpu, gpu")
def export_onnx(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: OnnxOptions,
                inputs: ExportInputs) -> ExportResult:
    import onnx

    opset = options.opset
    path = Path(out_dir) / "model.onnx"
    t0 = time.time()
    dynamic_size = options.dynamic_size
    axes_in = {0: "batch", 2: "height", 3: "width"} if dynamic_size else {0: "batch"}
    detections = holds_nms(model)
    # a segmentation output (batch, classes, height, width) follows a free input size; a detector's [K, 7] rows
    # have as many rows as it finds in the whole batch, their own free axis
    axes_out = ({0: "detections"} if detections else
                {0: "batch", 2: "height", 3: "width"} if dynamic_size and _output_is_spatial(model, example)
                else {0: "batch"})
    output = "detections" if detections else "output"
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    external = weight_bytes > options.external_data_mb * 2 ** 20
    data_name = external_data_file(path).name

    def write(tmp: Path) -> None:
        # The TorchScript exporter writes exactly the opset asked for; the dynamo exporter may silently
        # write a newer one, which older runtimes on devices reject.
        torch.onnx.export(model, (example[:1],), str(tmp), opset_version=opset, input_names=["input"],
                          output_names=[output], dynamic_axes={"input": axes_in, output: axes_out},
                          dynamo=False)
        proto = onnx.load(str(tmp))
        if options.slim:
            import onnxslim

            proto = onnxslim.slim(proto)
        for k, v in inputs.metadata.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = k, v if isinstance(v, str) else json.dumps(v)
        if external:  # the data file takes its final name beside the temporary model, which is renamed last
            (Path(out_dir) / data_name).unlink(missing_ok=True)
            onnx.save(proto, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=data_name, size_threshold=1024)
            onnx.checker.check_model(str(tmp))
        else:
            onnx.checker.check_model(proto)
            onnx.save(proto, str(tmp))

    atomic_write(path, write)
    written = {o.domain or "ai.onnx": o.version for o in onnx.load(str(path), load_external_data=False).opset_import}
    if written.get("ai.onnx") != opset:
        raise ToolchainError(f"onnx: asked for opset {opset} but the file has {written}; pin the opset the "
                             f"exporter supports or update export.options.onnx.opset")

    run = cpu_runner(path)
    meta = {"opset_written": written.get("ai.onnx"), "opsets": written, "seconds": round(time.time() - t0, 2),
            "dynamic": list(axes_in.values()), "external_data": data_name if external else None}
    if dynamic_size:  # the shapes really are free: run a second input size through the file
        meta["dynamic_size_check"] = _check_other_size(model, example, run)
    return ExportResult(path, meta, runner=run)


def cpu_runner(path: Path):
    """``run(x) -> outputs`` of an ONNX file on ONNX Runtime pinned to its CPU provider (the ``onnxruntime_cpu``
    runtime): the parity and accuracy checks of every ONNX artifact run the code that times it."""
    return load_onnxruntime(path, providers=["CPUExecutionProvider"])


def external_data_file(path: Path) -> Path:
    """Where an ONNX model's external weights live: beside it, under the name recorded inside the model."""
    return Path(path).with_name(Path(path).name + ".data")


def _output_is_spatial(model: torch.nn.Module, example: torch.Tensor) -> bool:
    with torch.no_grad():
        return model(example[:1]).ndim == 4


def _check_other_size(model: torch.nn.Module, example: torch.Tensor, run) -> Dict[str, Any]:
    """Parity at about 1.25x the export size on each side, other multiples of 32 (every student's stride
    allows them); a 4:3 export is checked at another 4:3-ish size."""
    def other(side: int) -> int:
        new = -(-int(side * 1.25) // 32) * 32
        return new if new != side else new + 32

    hw = (other(example.shape[-2]), other(example.shape[-1]))
    at = f"{hw[0]}x{hw[1]} (h x w)"
    x = torch.nn.functional.interpolate(example[:2], size=hw, mode="bilinear", align_corners=False)
    with torch.no_grad():
        ref = model(x).numpy()
    fix = ("the traced graph fixes the input size (MobileViT's unfold does, FastViT does not); set "
           "export.options.onnx.dynamic_size: false and export at the size the app uses")
    try:
        got = run(x.numpy())
    except Exception as exc:  # onnxruntime's own error names the node that baked the shape
        raise ToolchainError(f"onnx with dynamic height/width fails at {at}: {str(exc).strip()[:300]}; {fix}")
    if holds_nms(model):
        # final detections are matched box by box, not element by element (their count may differ by one at the
        # score threshold): the export stage matches them at this size (export/parity.py)
        if got.ndim != 2 or got.shape[1] != 7:
            raise ToolchainError(f"onnx with dynamic height/width gives detections of shape {got.shape} at {at}, "
                                 f"not [K, 7]; {fix}")
        return {"image_size": list(hw), "max_abs_diff": None}
    if got.shape != ref.shape:
        raise ToolchainError(f"onnx with dynamic height/width gives shape {got.shape} at {at} where PyTorch "
                             f"gives {ref.shape}; {fix}")
    return {"image_size": list(hw), "max_abs_diff": float(np.abs(got - ref).max())}
