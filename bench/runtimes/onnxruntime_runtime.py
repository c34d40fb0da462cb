"""ONNX Runtime with the best execution provider available (TensorRT, CUDA, then CPU)."""
from __future__ import annotations

import numpy as np

from bench.runtimes.base import RUNTIMES


@RUNTIMES.register("onnxruntime", artifact=["onnx", "onnx_fp16", "onnx_int8"],
                   devices="cpu; cuda / tensorrt with onnxruntime-gpu")
def load_onnxruntime(path, threads=None, providers=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    available = ort.get_available_providers()
    providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    run.provider = session.get_providers()[0]
    return run
