"""User-facing errors.

A :class:`ToolchainError` is raised for anything the user can fix (bad recipe, bad data, missing
checkpoint).  The CLI prints its message without a traceback; everything else is a bug.
"""

__all__ = ["ToolchainError", "NonFiniteLossError"]


class ToolchainError(Exception):
    """Something in the user's input is wrong; the message says what and what is allowed."""


class NonFiniteLossError(ToolchainError):
    """Training produced NaN/Inf; the last good checkpoint is kept for inspection or resume."""
