"""ONNX Runtime: ``onnxruntime`` takes the best execution provider present (TensorRT, CUDA, then CPU);
``onnxruntime_cpu`` / ``_cuda`` / ``_tensorrt`` pin one, so a recipe can time the same ONNX file under
each side by side.  A pinned provider that this machine lacks is reported as unavailable, never replaced
by another one silently (ONNX Runtime itself falls back to CPU without saying so)."""
from __future__ import annotations

import numpy as np

from bench.runtimes.base import RUNTIMES, Unavailable

_ARTIFACTS = ["onnx", "onnx_fp16", "onnx_int8"]
_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
              "tensorrt": "TensorrtExecutionProvider"}
_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def load_onnxruntime(path, threads=None, providers=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    available = ort.get_available_providers()
    if providers:
        missing = [p for p in providers if p not in available]
        if missing:
            raise Unavailable(f"onnxruntime {ort.__version__} here has {available}, not {missing} "
                              f"(install onnxruntime-gpu with CUDA / TensorRT)")
    else:
        providers = [p for p in _PREFERENCE if p in available]
    if "CPUExecutionProvider" not in providers:
        providers = [*providers, "CPUExecutionProvider"]  # nodes a GPU provider lacks still run
    session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    if session.get_providers()[0] != providers[0]:
        raise Unavailable(f"onnxruntime could not start {providers[0]} (it fell back to "
                          f"{session.get_providers()[0]})")
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    run.provider = session.get_providers()[0]
    return run


RUNTIMES.register("onnxruntime", artifact=_ARTIFACTS, devices="the best provider present")(load_onnxruntime)
for _short, _provider in _PROVIDERS.items():
    RUNTIMES.register(f"onnxruntime_{_short}", artifact=_ARTIFACTS, devices=_short)(
        lambda path, threads=None, _p=_provider: load_onnxruntime(path, threads, [_p]))
