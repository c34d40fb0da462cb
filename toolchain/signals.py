"""SIGTERM handled like Ctrl-C.

Schedulers (Slurm, Kubernetes, Docker's ``stop``) end a job with SIGTERM and only later SIGKILL.  Python's
default for SIGTERM is to die at once: no ``interrupted`` record, no message, and a stage's last atomic write
may be cut.  Inside :func:`terminate_as_interrupt` SIGTERM raises :class:`Terminated`, a ``KeyboardInterrupt``,
so every path that already handles Ctrl-C (checkpoints kept, the stage recorded ``interrupted``, one message)
handles it too, and the command exits 143 as a terminated process should.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["Terminated", "terminate_as_interrupt", "EXIT_TERMINATED"]

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM."""


def _raise(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while cleaning up ends the process
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
