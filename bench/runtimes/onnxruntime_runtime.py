"""ONNX Runtime: ``onnxruntime`` takes the best execution provider present (TensorRT, CUDA, then CPU);
``onnxruntime_cpu`` / ``_cuda`` / ``_tensorrt`` pin one, so a recipe can time the same ONNX file under
each side by side.  A pinned provider that this machine lacks is reported as unavailable, never replaced
by another one silently (ONNX Runtime itself falls back to CPU without saying so)."""
from __future__ import annotations

import numpy as np

from bench.runtimes.base import RUNTIMES, Unavailable

_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
              "tensorrt": "TensorrtExecutionProvider"}
_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def _start(ort, path, opts, chain):
    """A session whose first provider is ``chain[0]``; ONNX Runtime's own silent fallback is an error here."""
    session = ort.InferenceSession(str(path), sess_options=opts, providers=chain)
    if session.get_providers()[0] != chain[0]:
        raise Unavailable(f"it fell back to {session.get_providers()[0]}")
    return session


def load_onnxruntime(path, threads=None, providers=None):
    """``providers=None``: the best provider that starts, trying TensorRT, then CUDA, then CPU (a TensorRT
    engine build can fail on an op or a shape where CUDA runs fine); ``run.provider`` says which one runs and
    ``run.fell_back`` what failed before it and why.  A pinned provider that fails is Unavailable."""
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
        candidates = [list(providers)]
    else:
        candidates = [[p] for p in _PREFERENCE if p in available]
    fell_back, session = [], None
    for chain in candidates:
        if "CPUExecutionProvider" not in chain:
            chain = [*chain, "CPUExecutionProvider"]  # nodes a GPU provider lacks still run
        try:
            session = _start(ort, path, opts, chain)
            break
        except Exception as exc:  # the provider's own error types differ; each is reported, then the next tried
            fell_back.append(f"{chain[0]}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__}")
    if session is None:
        raise Unavailable(f"onnxruntime could not start {'; '.join(fell_back)}")
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    run.provider = session.get_providers()[0]
    run.fell_back = fell_back
    return run


# every format that declares runtime="onnxruntime" (onnx, onnx_fp16, onnx_int8, ...) runs here
RUNTIMES.register("onnxruntime", runs="onnxruntime", devices="the best provider present")(load_onnxruntime)
for _short, _provider in _PROVIDERS.items():
    RUNTIMES.register(f"onnxruntime_{_short}", runs="onnxruntime", devices=_short)(
        lambda path, threads=None, _p=_provider: load_onnxruntime(path, threads, [_p]))
