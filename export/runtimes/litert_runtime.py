"""LiteRT: a ``.tflite`` file run by the LiteRT interpreter (``ai_edge_litert``) with its default XNNPACK CPU
delegate and the given thread count, the CPU path an Android app takes.  Files are converted at batch 1; a larger
batch runs one image after another.  A full-integer file takes and gives int8 tensors: the runner quantizes the
float input and dequantizes the output with the file's own scale and zero point, as an app does."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, artifact, described, per_image
from .nms import with_nms

ENTRIES = {"litert": {"runs": "litert", "devices": "cpu (xnnpack)", "from_record": ("runtime_nms",)}}


def load(path, threads=None, runtime_nms=None):
    """``runtime_nms``: a detector's candidates file is finished by the shared NMS (nms.py) with these settings."""
    path = artifact(path, "litert")
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as why:
        raise Unavailable(f"ai-edge-litert is not installed ({why}); pip install ai-edge-litert") from None
    interpreter = Interpreter(model_path=str(path), num_threads=int(threads) if threads else None)
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()

    def call(x: np.ndarray) -> np.ndarray:
        interpreter.set_tensor(inp["index"], _to(x, inp))
        interpreter.invoke()
        return _from(interpreter.get_tensor(out["index"]), out)

    run = per_image(call)
    return described(with_nms(run, runtime_nms) if runtime_nms else run, f"xnnpack ({threads or 'default'} threads)",
                     threads)


def _to(x: np.ndarray, detail) -> np.ndarray:
    """Float input into the tensor's type: quantized with its (scale, zero point) when it is an integer tensor."""
    if not np.issubdtype(detail["dtype"], np.integer):
        return x.astype(detail["dtype"])
    scale, zero = detail["quantization"]
    info = np.iinfo(detail["dtype"])
    return np.clip(np.round(x / scale) + zero, info.min, info.max).astype(detail["dtype"])


def _from(y: np.ndarray, detail) -> np.ndarray:
    if not np.issubdtype(detail["dtype"], np.integer):
        return y.astype(np.float32)  # a copy: the interpreter reuses its buffer
    scale, zero = detail["quantization"]
    return (y.astype(np.float32) - zero) * scale
