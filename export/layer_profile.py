"""Which layers int8 makes slower, measured per layer with ONNX Runtime's profiler on this CPU.

A fully int8 model can lose to its fp32 original while most of its layers gain: ONNX Runtime's ``QLinearConv`` is
several times faster than fp32 on dense and 1x1 convolutions but an order of magnitude slower on some grouped ones
(FastViT's strided 7x7 downsampling convolutions), and those few decide the total.  ``slower_layers`` runs the fp32
and the fully quantized (QOperator) file under the profiler at batch 1 and returns the convolutions and matrix
multiplies whose int8 kernel, with the dequantization after it, takes longer than their fp32 kernel; ``onnx_int8``
then offers a candidate that keeps those in fp32 and lets whole-model timing and the accuracy gate decide.

Names: the profiler reports an fp32 node under its own name, or under its output's name plus ``_nchwc`` when ONNX
Runtime moved it to its blocked layout; the quantizer names a fused int8 node ``<name>_quant``, and the profiler may
add ``_token_<n>``.  A layer fused into another node (a convolution folded into the following ``Mul``) cannot be
told apart and stays quantized.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

__all__ = ["PROFILE", "slower_layers"]

PROFILE = {"warmup": 5, "runs": 20}  # batch-1 calls per file; a layer's time is its mean over the runs
LAYER_OPS = ("Conv", "MatMul", "Gemm")  # what ONNX Runtime's quantizer turns into integer kernels


def _kernel_times(path: Path, x: np.ndarray) -> Dict[str, float]:
    """Mean microseconds per call of every node kernel of ``path`` on the CPU provider, after a warmup: the runtime
    layer's table of it (export/runtimes/onnxruntime_runtime.py ``layers``), by the profiler's node names."""
    from vfm_toolchain.export.runtimes.onnxruntime_runtime import layers

    table = layers(path, x, warmup=PROFILE["warmup"], runs=PROFILE["runs"], providers=["CPUExecutionProvider"])
    return {row["name"]: row["ms"] * 1e3 for row in table["rows"]}


def slower_layers(fp32: Path, int8: Path, shape) -> Tuple[List[str], Dict[str, Tuple[float, float]]]:
    """``(names, profile)``: the fp32 graph's ``Conv`` / ``MatMul`` / ``Gemm`` nodes that run slower in the QOperator
    file ``int8`` than in ``fp32``, and ``profile[name] = (fp32_ms, int8_ms)`` for every layer matched in both."""
    import onnx

    graph = onnx.load(str(fp32), load_external_data=False).graph
    layers = {n.name: n.output[0] for n in graph.node if n.op_type in LAYER_OPS}
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    t32, t8 = _kernel_times(fp32, x), _kernel_times(int8, x)
    by_output = {out + "_nchwc": name for name, out in layers.items()}
    fp32_ms = {}
    for key, us in t32.items():
        name = key if key in layers else by_output.get(key)
        if name is not None:
            fp32_ms[name] = us / 1e3
    int8_ms = {}
    for key, us in t8.items():
        m = re.fullmatch(r"(.*)_quant(?:_token_\d+)?", key)
        if m and m.group(1) in layers:  # the integer kernel and the dequantization of its output, if any
            int8_ms[m.group(1)] = (us + t8.get(layers[m.group(1)] + "_DequantizeLinear", 0.0)) / 1e3
    profile = {k: (round(fp32_ms[k], 4), round(int8_ms[k], 4)) for k in layers if k in fp32_ms and k in int8_ms}
    return [k for k, (a, b) in profile.items() if b > a], profile
