"""ONNX Runtime, one provider policy for the build and the device: ``onnxruntime`` takes the best execution
provider that starts (TensorRT, CUDA, Core ML, then the CPU) and says which one ran and what failed before it;
``onnxruntime_cpu`` / ``_cuda`` / ``_tensorrt`` / ``_coreml`` pin one, so a recipe can time the same ONNX file
under each side by side, and the export stage's parity and accuracy checks pin the CPU.  A pinned provider this
machine lacks, or one that does not start, is reported as unavailable, never replaced by another one silently
(ONNX Runtime itself falls back to the CPU without saying so)."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, artifact, described

PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider", "CPUExecutionProvider")
_PINNED = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
           "coreml": "CoreMLExecutionProvider"}

_WHERE = {"CUDAExecutionProvider": "onnxruntime-gpu on an NVIDIA GPU has it",
          "TensorrtExecutionProvider": "onnxruntime-gpu with TensorRT installed has it",
          "CoreMLExecutionProvider": "onnxruntime on macOS has it"}

ENTRIES = {"onnxruntime": {"runs": "onnxruntime", "devices": "the best provider present"},
           **{f"onnxruntime_{short}": {"runs": "onnxruntime", "devices": short, "options": {"providers": [provider]}}
              for short, provider in _PINNED.items()}}


def _start(ort, path, opts, chain):
    """A session whose first provider is ``chain[0]``; ONNX Runtime's own silent fallback is an error here."""
    session = ort.InferenceSession(str(path), sess_options=opts, providers=chain)
    if session.get_providers()[0] != chain[0]:
        raise Unavailable(f"it fell back to {session.get_providers()[0]}")
    return session


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def load(path, threads=None, providers=None):
    """``providers=None``: the best provider that starts, in :data:`PREFERENCE` order (a TensorRT engine build can
    fail on an op or a shape where CUDA runs fine); ``run.fell_back`` lists what failed before it and why.  A
    pinned provider that fails is :class:`Unavailable`."""
    path = artifact(path, "onnxruntime")
    try:
        import onnxruntime as ort
    except ImportError as why:
        raise Unavailable(f"onnxruntime is not installed ({why}); pip install onnxruntime "
                          f"(onnxruntime-gpu on a CUDA machine)") from None

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = int(threads)
    available = ort.get_available_providers()
    if providers:
        missing = [p for p in providers if p not in available]
        if missing:
            raise Unavailable(f"onnxruntime {ort.__version__} here has {available}, not {missing} "
                              f"({'; '.join(_WHERE.get(p, p) for p in missing)})")
        candidates = [list(providers)]
    else:
        candidates = [[p] for p in PREFERENCE if p in available]
    fell_back, session = [], None
    for chain in candidates:
        if "CPUExecutionProvider" not in chain:
            chain = [*chain, "CPUExecutionProvider"]  # nodes a GPU provider lacks still run
        try:
            session = _start(ort, path, opts, chain)
            break
        except Exception as exc:  # the providers' own error types differ; each is reported, then the next tried
            fell_back.append(f"{chain[0]}: {_first_line(exc)}")
    if session is None:
        raise Unavailable(f"onnxruntime could not start {'; '.join(fell_back)}")
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    run.fell_back = fell_back
    return described(run, session.get_providers()[0], threads)
