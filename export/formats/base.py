from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from toolchain.registry import Registry

__all__ = ["FORMATS", "ExportResult", "Skipped"]

FORMATS = Registry("export format")


class Skipped(Exception):
    """The format cannot be produced on this machine; the message is the reason recorded in the build."""


@dataclass
class ExportResult:
    path: Path
    meta: Dict[str, Any] = field(default_factory=dict)
    # run(batch) -> outputs on this machine, or None when the artifact cannot execute here
    runner: Optional[Any] = None
    parity_skipped: Optional[str] = None
