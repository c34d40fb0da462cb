"""One generic registry: ``register``, ``get``, ``list`` (timm's three verbs).

Every extensible thing in the toolchain (teachers, adapters, curation strategies, students, export
formats, runtimes, stages) lives in a :class:`Registry`.  Unknown names raise a :class:`ToolchainError`
that lists the valid names and suggests the closest one, so a recipe typo is fixed in one read.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["Registry", "did_you_mean", "natural_key"]


def natural_key(text: str) -> List[Any]:
    """Sort key that orders ``vit_s14`` before ``vit_s104`` (natural sort)."""
    return [int(tok) if tok.isdigit() else tok.lower() for tok in re.split(r"(\d+)", text)]


def did_you_mean(name: str, candidates: List[str]) -> str:
    """A short "did you mean 'x'?" hint, or an empty string when nothing is close."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


class Registry:
    """A named table of factories with free-form metadata per entry.

    ``kind`` is the noun used in messages ("teacher", "export format", ...).
    ``prefix_sep`` lets an entry own a whole namespace: ``timm:`` resolves ``timm:vit_small...``.
    """

    def __init__(self, kind: str, prefix_sep: Optional[str] = None):
        self.kind = kind
        self.prefix_sep = prefix_sep
        self._entries: Dict[str, Tuple[Callable[..., Any], Dict[str, Any]]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``@REG.register("name", foldable=True)``."""

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = (fn, dict(meta))
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Remove an entry by its exact name: a test's stand-in, or a plugin that is unloaded (registering a name
        twice is refused)."""
        if name not in self._entries:
            raise ToolchainError(f"unknown {self.kind} '{name}'; registered: {', '.join(self.list())}")
        del self._entries[name]

    def _resolve(self, name: str) -> str:
        if name in self._entries:
            return name
        if self.prefix_sep and self.prefix_sep in name:
            prefix = name.split(self.prefix_sep, 1)[0] + self.prefix_sep
            if prefix in self._entries:
                return prefix
        raise ToolchainError(
            f"unknown {self.kind} '{name}'.{did_you_mean(name, list(self._entries))} "
            f"Valid {self.kind} names: {', '.join(self.list())}."
        )

    def get(self, name: str) -> Callable[..., Any]:
        return self._entries[self._resolve(name)][0]

    def meta(self, name: str) -> Dict[str, Any]:
        return dict(self._entries[self._resolve(name)][1])

    def check(self, name: str) -> str:
        """Validate a name without building anything; returns the registry key it resolves to."""
        return self._resolve(name)

    def list(self, pattern: str = "*") -> List[str]:
        return sorted((n for n in self._entries if fnmatch.fnmatch(n, pattern)), key=natural_key)

    def __contains__(self, name: str) -> bool:
        try:
            self._resolve(name)
            return True
        except ToolchainError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.list())

    def __len__(self) -> int:
        return len(self._entries)
