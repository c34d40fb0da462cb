"""The adapter registry and the contract every adapter file fulfils.

An adapter registers ``Adapter(config=..., apply=..., fold=None, init_from_features=None)`` with metadata
(``foldable``, ``source``).  ``config`` is a pydantic class that owns the adapter's options and rejects
unknown keys; ``apply(backbone, options)`` makes the backbone trainable the adapter's way in place;
``fold(backbone)`` (foldable adapters) returns plain weights computing the same outputs;
``init_from_features(backbone, features)`` (optional) sees the training images' features once before
training (LLU keeps representatives of them); ``regularizer(backbone)`` (optional) is added to the loss;
``pretrain(backbone, ctx)`` (optional) runs a label-free phase first (grappa's pseudo-granularities).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch
from pydantic import BaseModel, ConfigDict

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry
from vfm_toolchain.recipe import AdapterConfig, validate_options
from vfm_toolchain.teachers.backbones.base import Backbone

__all__ = ["ADAPTERS", "Adapter", "AdapterOptions", "PretrainContext", "pretrain_adapter", "adapter_options", "apply_adapter", "fold_adapter",
           "init_adapter_from_features"]

ADAPTERS = Registry("adapter")


class AdapterOptions(BaseModel):
    """Base of every adapter's config: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class PretrainContext:
    """What an adapter's label-free pretraining phase may use (grappa's pseudo-label phase)."""

    train_paths: List[str]
    pool_paths: List[str]
    preprocess: Any
    seed: int
    batch_size: int
    workdir: Path
    log: logging.Logger


@dataclass
class Adapter:
    config: type
    apply: Callable[[Backbone, Any], Backbone]
    fold: Optional[Callable[[Backbone], Backbone]] = None
    init_from_features: Optional[Callable[[Backbone, torch.Tensor], None]] = None
    regularizer: Optional[Callable[[Backbone], torch.Tensor]] = None  # added to the training loss
    pretrain: Optional[Callable[[Backbone, PretrainContext], None]] = None  # runs before the labels are used


def adapter_options(cfg: AdapterConfig) -> Any:
    """The adapter's own validated options (raises ToolchainError naming the bad key)."""
    return validate_options(ADAPTERS.get(cfg.name).config, cfg.options(), "teacher.adapter")


def apply_adapter(backbone: Backbone, cfg: AdapterConfig) -> Backbone:
    return ADAPTERS.get(cfg.name).apply(backbone, adapter_options(cfg))


def init_adapter_from_features(backbone: Backbone, cfg: AdapterConfig, features: torch.Tensor) -> None:
    hook = ADAPTERS.get(cfg.name).init_from_features
    if hook is not None:
        hook(backbone, features)


def pretrain_adapter(backbone: Backbone, cfg: AdapterConfig, ctx: PretrainContext) -> None:
    hook = ADAPTERS.get(cfg.name).pretrain
    if hook is not None:
        hook(backbone, ctx)


def needs_features(cfg: AdapterConfig) -> bool:
    return ADAPTERS.get(cfg.name).init_from_features is not None


def adapter_regularizer(backbone: Backbone, cfg: AdapterConfig) -> Optional[Callable[[], torch.Tensor]]:
    reg = ADAPTERS.get(cfg.name).regularizer
    return None if reg is None else (lambda: reg(backbone))


def fold_adapter(backbone: Backbone, cfg: AdapterConfig) -> Backbone:
    """Return a backbone with the adapter folded into plain weights.

    Raises:
        ToolchainError: the adapter does not fold; the export then keeps its extra ops.
    """
    entry = ADAPTERS.get(cfg.name)
    if not ADAPTERS.meta(cfg.name)["foldable"] or entry.fold is None:
        raise ToolchainError(f"adapter '{cfg.name}' does not fold into plain weights; "
                             f"its extra ops are exported as they are")
    return entry.fold(backbone)
