"""Runtimes, one file each.  Contract: ``load(artifact, threads) -> callable(np.ndarray) -> np.ndarray``;
a runtime that cannot run here raises :class:`Unavailable` with the reason."""
from bench.runtimes.base import RUNTIMES, Unavailable
from bench.runtimes import (pytorch_runtime, onnxruntime_runtime, tensorrt_runtime, coreml_runtime,  # noqa: F401
                           executorch_runtime, litert_runtime, openvino_runtime)

__all__ = ["RUNTIMES", "Unavailable"]
