"""TensorRT engine built from the ONNX artifact with the TensorRT Python API (TensorRT 10).

TensorRT is not installable from the registries this machine reaches and needs an NVIDIA GPU; here the
format reports itself skipped with that reason.  On a GPU machine it builds an engine whose optimisation
profile spans every batch the build feeds it (parity, accuracy scoring, every bench batch; larger inputs run
in chunks), with a timing cache kept in the store, one per GPU model and TensorRT version and shared by all
builds, and runs the parity gate through the engine.  Precisions: fp32; fp16 with normalisation, softmax and
reduction layers pinned to fp32 (they overflow or lose the mean in fp16: the ViT accuracy collapse users
report); int8 by explicit quantization, the path TensorRT 10 supports (its implicit calibrators are deprecated):
the fp32 ONNX is quantized with symmetric int8 Q/DQ nodes calibrated on transfer-set images
(``quantize_qdq``), and a strongly typed network built from that file runs int8 exactly where the Q/DQ nodes
say and fp32 elsewhere, with no precision flags (TensorRT: "use explicit quantization with strong typing").

A detector's engine is built from its candidates' ONNX (students/fold.py ``nms_outside``: every location's decoded box
and class scores, a static shape), not from the build's ONNX with its NMS, and the runtime layer's NMS
(export/runtimes/nms.py, the one ExecuTorch and LiteRT use) finishes it: the engine then holds only the network,
whose layers TensorRT builds as it builds any CNN, where the ONNX NMS graph would bring a data-dependent output
and ops outside TensorRT's types (a float64 sort key).  TensorRT's own NMS (``INMSLayer``, the EfficientNMS plugin)
would save the candidates' copy to the host, which the bench's ``nms_ms`` measures.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from filelock import FileLock

from pydantic import Field

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes
from vfm_toolchain.export.formats.base import ExportInputs, ExportResult, FormatOptions, Skipped, register_format
from vfm_toolchain.export.formats.onnx_quantized_format import postprocess_nodes, quantize_qdq
from vfm_toolchain.export.runtimes.tensorrt_runtime import load as load_engine
from vfm_toolchain.students.fold import nms_outside


def _require_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise Skipped("TensorRT is not installed (pip install 'vfm-toolchain[tensorrt]' --extra-index-url "
                      "https://pypi.nvidia.com on a machine with an NVIDIA GPU; the Docker image has it)") from None
    if not torch.cuda.is_available():
        raise Skipped("TensorRT needs an NVIDIA GPU and none is visible to PyTorch")
    return trt


def _pin_fp32(trt, network) -> int:
    """Keep the layers that misbehave in fp16 in fp32; returns how many were pinned."""
    kinds = {getattr(trt.LayerType, n) for n in ("NORMALIZATION", "SOFTMAX", "REDUCE") if hasattr(trt.LayerType, n)}
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in kinds:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def network_flags(trt, precision: str) -> int:
    """``create_network`` flags: int8 engines are strongly typed (explicit quantization), the others are not
    (fp16 is asked for with a builder flag and the layers pinned to fp32 by ``_pin_fp32``).  Explicit batch is
    TensorRT 10's only mode, so it needs no flag."""
    if precision == "int8":
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0


def profile_shapes(batches, shape) -> tuple:
    """The optimisation profile (min, opt, max input shapes) that spans every batch size the build feeds the
    engine: the parity check, accuracy scoring and every bench batch.  ``opt``, where TensorRT tunes its
    kernels, is the middle one of those sizes."""
    sizes = sorted({int(b) for b in batches if int(b) >= 1}) or [1]
    return (1, *shape), (sizes[len(sizes) // 2], *shape), (sizes[-1], *shape)


def shared_timing_cache(cache_dir: Path, trt) -> Path:
    """One timing cache per (GPU model, TensorRT version) in the store, reused by every build on that pair
    (kernel timings do not depend on the model, and a warm cache cuts engine builds from minutes to seconds)."""
    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return Path(cache_dir) / "tensorrt" / f"{gpu}-trt{trt.__version__}.cache"


class TensorRTOptions(FormatOptions):
    precision: Literal["fp32", "fp16", "int8"] = Field(
        "fp16", description="int8 is calibrated on the transfer set (explicit Q/DQ) and judged by test accuracy")
    workspace_gb: float = Field(2.0, gt=0, description="builder workspace memory limit")


@register_format("tensorrt", options=TensorRTOptions, runtime="tensorrt", source="onnx", bundle=False,
                 batch_profile=True, targets=("nvidia",), suffix=".engine", devices="nvidia gpu",
                 precision="options.precision")
def export_tensorrt(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, options: TensorRTOptions,
                    inputs: ExportInputs) -> ExportResult:
    trt = _require_tensorrt()
    net, detection = nms_outside(model)
    onnx_path = _candidates_onnx(net, example, Path(out_dir)) if detection else inputs.need_onnx("tensorrt")
    precision = options.precision
    t0 = time.time()
    source, extra = Path(onnx_path), {}
    if precision == "int8":
        calib = inputs.need_calibration("tensorrt int8")
        source = Path(out_dir) / "model.qdq.onnx"  # kept beside the engine: the exact graph TensorRT built
        # a detector's decoding stays float (onnx_quantized_format.postprocess_nodes says why)
        quantize_qdq(Path(onnx_path), source, np.asarray(calib), per_channel=True, symmetric=True,
                     exclude=postprocess_nodes(Path(onnx_path)) if detection else ())
        extra = {"calibration_images": int(len(calib)), "quantization": "explicit (symmetric int8 Q/DQ)",
                 "qdq_onnx": source.name}
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, precision))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(source)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ToolchainError(f"tensorrt: could not parse {source}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * 2 ** 30))
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # each layer's precision and tactic, for its layer table
    cache_file = shared_timing_cache(inputs.cache_dir, trt) if inputs.cache_dir else Path(out_dir) / "timing.cache"
    timing = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
    config.set_timing_cache(timing, ignore_mismatch=False)
    pinned = 0
    if precision == "fp16":  # int8 is strongly typed: its types come from the Q/DQ graph, no precision flags
        config.set_flag(trt.BuilderFlag.FP16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        pinned = _pin_fp32(trt, network)
    lo, opt, hi = profile_shapes(inputs.batches, tuple(example.shape[1:]))
    max_batch = hi[0]
    profile = builder.create_optimization_profile()
    profile.set_shape("input", lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ToolchainError("tensorrt: engine build failed (see the TensorRT log above)")
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_file) + ".lock"):  # builds on other processes share the file
        atomic_write_bytes(cache_file, bytes(config.get_timing_cache().serialize()))
    path = Path(out_dir) / "model.engine"
    atomic_write_bytes(path, bytes(serialized))
    # the runtime that times it: parity runs the engine file as written, a detector's with the shared NMS
    run = load_engine(path, runtime_nms=detection.get("runtime_nms"))
    return ExportResult(path, {"seconds": round(time.time() - t0, 2), "precision": precision, "max_batch": max_batch,
                               "fp32_layers": pinned, "timing_cache": str(cache_file),
                               "tensorrt": trt.__version__, **extra, **detection}, runner=run)


def _candidates_onnx(net: torch.nn.Module, example: torch.Tensor, out_dir: Path) -> Path:
    """A detector's candidates as an fp32 ONNX file kept beside the engine (the graph TensorRT parsed)."""
    from vfm_toolchain.export.formats.base import format_options
    from vfm_toolchain.export.formats.onnx_format import export_onnx

    return export_onnx(net, example, out_dir / "candidates", format_options("onnx"), ExportInputs()).path
