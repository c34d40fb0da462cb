"""Runtimes, one file each.  Contract: ``load(artifact, threads) -> callable(np.ndarray) -> np.ndarray``."""
from bench.runtimes.base import RUNTIMES
from bench.runtimes import pytorch_runtime, onnxruntime_runtime  # noqa: F401  (register)

__all__ = ["RUNTIMES"]
