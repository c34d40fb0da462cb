"""The parity gate: an artifact is accepted only if it reproduces the folded PyTorch model on real inputs."""
from __future__ import annotations

import numpy as np

from vfm_toolchain.errors import ToolchainError

__all__ = ["ParityError", "check_parity"]


class ParityError(ToolchainError):
    """An exported artifact disagrees with PyTorch beyond its tolerance; the build fails."""


def check_parity(name: str, reference: np.ndarray, candidate: np.ndarray, atol: float) -> float:
    if reference.shape != candidate.shape:
        raise ParityError(f"{name}: output shape {candidate.shape} differs from PyTorch {reference.shape}")
    if not np.all(np.isfinite(candidate)):
        raise ParityError(f"{name}: output has NaN/Inf where PyTorch has finite values")
    diff = float(np.max(np.abs(reference.astype(np.float64) - candidate.astype(np.float64))))
    if diff > atol:
        raise ParityError(f"{name}: max |PyTorch - artifact| = {diff:.3g} exceeds the tolerance {atol:.3g}; "
                          f"the artifact is rejected (raise export.parity_atol only if this drift is acceptable)")
    return diff
