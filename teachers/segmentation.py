"""The teacher's segmentation form (seed 004 A.1): a ViT at output stride 8 with a DeepLabV3 head.

The patch embedding keeps its kernel (14 for DINOv2) but moves with stride 8, padded by (kernel - 8) / 2
so the patch grid is exactly input / 8; the position embeddings are resampled to the new grid.  The
DeepLabV3 head (ASPP) runs on the patch-token grid and its logits are upsampled to the input size.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from teachers.adapters import apply_adapter
from teachers.adapters.blocks import ThenAdapter
from teachers.backbones import create_backbone
from toolchain.checkpoint import MODEL_FAMILIES
from toolchain.errors import ToolchainError
from toolchain.recipe import AdapterConfig

__all__ = ["set_patch_stride", "SegmentationTeacher", "create_segmentation_teacher", "segmentation_teacher_spec"]


@torch.no_grad()
def set_patch_stride(vit: nn.Module, stride: int) -> nn.Module:
    """Change a timm ViT's patch-embedding stride in place and resample its position embeddings."""
    from timm.layers import resample_abs_pos_embed

    pe = getattr(vit, "patch_embed", None)
    if pe is None or not hasattr(pe, "proj") or getattr(vit, "pos_embed", None) is None:
        raise ToolchainError("the segmentation form needs a timm ViT with absolute position embeddings "
                             "(e.g. timm:vit_large_patch14_dinov2.lvd142m)")
    k = pe.patch_size[0]
    if stride > k:
        raise ToolchainError(f"patch stride {stride} is larger than the patch size {k}: pixels would be skipped")
    old_grid = tuple(pe.grid_size)
    pad = (k - stride) // 2
    pe.proj.stride, pe.proj.padding = (stride, stride), (pad, pad)
    h, w = pe.img_size
    new_grid = ((h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1)
    pe.grid_size, pe.num_patches = new_grid, new_grid[0] * new_grid[1]
    prefix = 0 if getattr(vit, "no_embed_class", False) else vit.num_prefix_tokens
    vit.pos_embed = nn.Parameter(resample_abs_pos_embed(vit.pos_embed.data, list(new_grid), list(old_grid),
                                                        num_prefix_tokens=prefix))
    return vit


class SegmentationTeacher(nn.Module):
    def __init__(self, backbone: nn.Module, num_classes: int):
        super().__init__()
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead

        self.backbone = backbone
        self.head = DeepLabHead(backbone.num_features, num_classes)

    def vit(self) -> nn.Module:
        model = self.backbone.model
        return getattr(model, "model", model)  # inside an adapter wrapper (PEFT LoraModel) or not

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, D, H/8, W/8)
        vit = self.vit()
        tokens = vit.forward_features(x)                               # (B, N, D)
        gh, gw = vit.patch_embed.grid_size
        patches = tokens[:, vit.num_prefix_tokens:]                    # (B, gh*gw, D)
        return patches.transpose(1, 2).reshape(x.shape[0], -1, gh, gw)

    def forward_logits(self, x: torch.Tensor) -> torch.Tensor:        # (B, C, H/8, W/8), before upsampling
        return self.head(self.forward_features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (B, C, H, W)
        return F.interpolate(self.forward_logits(x), size=x.shape[-2:], mode="bilinear", align_corners=False)


def create_segmentation_teacher(name: str, weights: str, image_size: Optional[int], num_classes: int,
                                adapter: AdapterConfig, stride: int = 8) -> SegmentationTeacher:
    backbone = create_backbone(name, weights, image_size)
    set_patch_stride(backbone.model, stride)
    backbone = apply_adapter(backbone, adapter)
    if isinstance(backbone.model, ThenAdapter):
        raise ToolchainError(f"adapter '{adapter.name}' changes the pooled embedding, which a segmentation teacher "
                             f"does not use; choose lora, full, linear or a block adapter")
    return SegmentationTeacher(backbone, num_classes)


def segmentation_teacher_spec(name: str, image_size: Optional[int], classes, adapter: AdapterConfig, preprocess) -> dict:
    return {"family": "segmentation_teacher", "name": name, "image_size": image_size, "num_classes": len(classes),
            "classes": list(classes), "adapter": adapter.model_dump(mode="json"), "preprocess": preprocess.to_dict(),
            "task": "segmentation"}


@MODEL_FAMILIES.register("segmentation_teacher")
def build_segmentation_teacher_from_spec(spec: dict) -> SegmentationTeacher:
    from toolchain.data import Preprocess

    model = create_segmentation_teacher(spec["name"], "none", spec["image_size"], spec["num_classes"],
                                        AdapterConfig(**spec["adapter"]))
    model.backbone.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model
