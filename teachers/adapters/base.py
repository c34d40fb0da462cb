from __future__ import annotations

from teachers.backbones.base import Backbone
from toolchain.errors import ToolchainError
from toolchain.recipe import AdapterConfig
from toolchain.registry import Registry

__all__ = ["ADAPTERS", "apply_adapter", "fold_adapter"]

ADAPTERS = Registry("adapter")


def apply_adapter(backbone: Backbone, cfg: AdapterConfig) -> Backbone:
    return ADAPTERS.get(cfg.name)["apply"](backbone, cfg)


def fold_adapter(backbone: Backbone, cfg: AdapterConfig) -> Backbone:
    """Return a backbone with the adapter folded into plain weights.

    Raises:
        ToolchainError: the adapter does not fold; the export then keeps its extra ops.
    """
    entry = ADAPTERS.get(cfg.name)
    if not ADAPTERS.meta(cfg.name)["foldable"]:
        raise ToolchainError(f"adapter '{cfg.name}' does not fold into plain weights; "
                             f"its extra ops are exported as they are")
    return entry["fold"](backbone)
