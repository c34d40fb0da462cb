"""TensorRT engine built from the ONNX artifact with the TensorRT Python API (TensorRT 10).

TensorRT is not installable from the registries this machine reaches and needs an NVIDIA GPU; here the
format reports itself skipped with that reason.  On a GPU machine it builds an engine with an
optimization profile for the dynamic batch and runs parity through the engine.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from export.formats.base import FORMATS, ExportResult, Skipped
from toolchain.errors import ToolchainError
from toolchain.store import atomic_write_bytes


def _require_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise Skipped("TensorRT is not installed (pip install tensorrt on a machine with an NVIDIA GPU)") from None
    if not torch.cuda.is_available():
        raise Skipped("TensorRT needs an NVIDIA GPU and none is visible to PyTorch")
    return trt


@FORMATS.register("tensorrt", suffix=".engine", devices="nvidia gpu", options=["precision", "max_batch", "onnx"])
def export_tensorrt(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, opts: Dict[str, Any]) -> ExportResult:
    trt = _require_tensorrt()
    onnx_path = opts.get("onnx")
    if not onnx_path:
        raise ToolchainError("tensorrt builds from the ONNX artifact: list 'onnx' before 'tensorrt' in export.formats")
    t0 = time.time()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ToolchainError(f"tensorrt: could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 2 << 30)
    if opts.get("precision") == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    shape = tuple(example.shape[1:])
    max_batch = int(opts.get("max_batch", 32))
    profile = builder.create_optimization_profile()
    profile.set_shape("input", (1, *shape), (max(1, max_batch // 2), *shape), (max_batch, *shape))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ToolchainError("tensorrt: engine build failed (see the TensorRT log above)")
    path = Path(out_dir) / "model.engine"
    atomic_write_bytes(path, bytes(serialized))
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    context = engine.create_execution_context()

    def run(x: np.ndarray) -> np.ndarray:
        inp = torch.from_numpy(x).cuda().contiguous()
        context.set_input_shape("input", tuple(inp.shape))
        out = torch.empty(tuple(context.get_tensor_shape("output")), device="cuda", dtype=torch.float32)
        context.set_tensor_address("input", inp.data_ptr())
        context.set_tensor_address("output", out.data_ptr())
        stream = torch.cuda.current_stream()
        context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return out.cpu().numpy()

    return ExportResult(path, {"seconds": round(time.time() - t0, 2), "precision": opts.get("precision", "fp32"),
                               "max_batch": max_batch, "tensorrt": trt.__version__}, runner=run)
