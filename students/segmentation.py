"""Segmentation students (seed 004 A.1): the timm backbone at output stride 8 (its last two stride-2
convolutions become stride 1), a DeepLabV3 (ASPP) head on the final feature map, and bilinear upsampling
of the logits to the input size.

MobileViT-V2 takes timm's ``output_stride=8`` (dilated); FastViT has no such option, so the stride-2
patch embeddings of its last two stages are set to stride 1 here.

Nothing in the forward reads a tensor's shape: the ASPP image-pooling branch is broadcast back over the
map instead of interpolated to ``x.shape``, and the logits are upsampled by a constant factor of 8.  Shape
arithmetic in a traced graph is what breaks Core ML conversion (and static-shape runtimes); the input side
must therefore be a multiple of 8.
"""
from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from torch import nn

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["SegmentationStudent", "output_stride_8", "create_segmentation_student"]


def output_stride_8(arch: str, pretrained: bool) -> nn.Module:
    """A timm backbone (no classifier) whose last feature map is input / 8."""
    try:
        return timm.create_model(arch, pretrained=pretrained, num_classes=0, output_stride=8)
    except TypeError:
        pass
    model = timm.create_model(arch, pretrained=pretrained, num_classes=0)
    stages = getattr(model, "stages", None)
    downs = [s.downsample for s in stages if hasattr(s, "downsample") and not isinstance(s.downsample, nn.Identity)] \
        if stages is not None else []
    if len(downs) < 2:
        raise ToolchainError(f"student '{arch}' has no output_stride option and no stage downsampling to change; "
                             f"segmentation supports MobileViT-V2, FastViT and timm models with output_stride")
    for down in downs[-2:]:
        for m in down.modules():
            s = getattr(m, "stride", None)
            if s == 2:
                m.stride = 1
            elif s == (2, 2):
                m.stride = (1, 1)
    return model


class SegmentationStudent(nn.Module):
    def __init__(self, arch: str, num_classes: int, pretrained: bool = False):
        super().__init__()
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead

        from vfm_toolchain.students.objectives import student_map_size

        self.body = output_stride_8(arch, pretrained)
        channels, h, w = student_map_size(self.body, (64, 64))
        if (h, w) != (8, 8):
            raise ToolchainError(f"student '{arch}' gives a {h}x{w} map at 64 px, not output stride 8")
        self.num_features = channels
        self.head = DeepLabHead(channels, num_classes)
        aspp = self.head[0]
        aspp.convs[-1] = _BroadcastPooling(aspp.convs[-1])

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H/8, W/8)
        return self.body.forward_features(x)

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x).mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, classes, H, W), H and W multiples of 8
        logits = self.head(self.forward_features(x))
        return F.interpolate(logits, scale_factor=8.0, mode="bilinear", align_corners=False)


class _BroadcastPooling(nn.Module):
    """torchvision's ASPPPooling with its 1x1 -> HxW bilinear resize (a constant) done by broadcasting."""

    def __init__(self, pooling: nn.Sequential):
        super().__init__()
        self.pooling = pooling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for m in self.pooling:
            out = m(out)
        return out + torch.zeros_like(x[:, :1])  # (B, C, 1, 1) + (B, 1, H, W) -> (B, C, H, W)


def create_segmentation_student(name: str, num_classes: int, weights: str = "none") -> "SegmentationStudent":
    """A registered student at output stride 8 with a DeepLabV3 head; a checkpoint (ImageNet or other weights)
    fills the backbone only."""
    from vfm_toolchain.checkpoint import load_matching, load_state_dict_safely
    from vfm_toolchain.students.models import check_timm_name

    arch = check_timm_name(name)
    try:
        model = SegmentationStudent(arch, num_classes, pretrained=weights == "pretrained")
    except ToolchainError:
        raise
    except Exception as exc:
        raise ToolchainError(f"could not build segmentation student '{name}' with weights '{weights}': "
                             f"{exc}") from None
    if weights not in ("none", "pretrained"):
        body = model.body
        state = {k: v for k, v in load_state_dict_safely(weights).items() if k in body.state_dict()}
        if not state:
            raise ToolchainError(f"checkpoint '{weights}' has no weights for student '{name}'")
        load_matching(body, state, weights, f"the backbone of student '{name}'")
    return model
