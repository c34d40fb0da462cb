"""The teacher's segmentation form (seed 004 A.1): a backbone at output stride 8 (or 16) with a DeepLabV3
head, from every teacher family the classification path accepts.

- timm ViTs (DINOv2): the patch embedding keeps its kernel (14 for DINOv2) but moves with stride 8, padded
  by (kernel - 8) / 2 so the patch grid is exactly input / 8; the position embeddings are resampled.
- OpenCLIP visual towers: the same on their ``conv1`` patch embedding and ``positional_embedding`` (A.1
  does this for OpenCLIP-L/14 too); the head reads the patch tokens after ``ln_post``.
- ConvNets from timm or torchvision: their last feature map, with the strided layers beyond the wanted
  stride set to stride 1 and every later convolution dilated to keep its receptive field (DeepLab's
  atrous convolution, as torchvision's ``replace_stride_with_dilation`` does for ResNets; checked equal
  to it in the tests).  Where each layer sits is measured with a probe forward, so any ConvNet whose
  3x3 / 5x5 convolutions are "same"-padded works.

The DeepLabV3 head (ASPP) runs on that grid; ``forward_logits`` returns its logits at the grid's
resolution (what distillation caches), ``forward`` upsamples them to the input size.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vfm_toolchain.checkpoint import MODEL_FAMILIES
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.teachers.adapters import apply_adapter
from vfm_toolchain.teachers.adapters.blocks import ThenAdapter
from vfm_toolchain.teachers.backbones import create_backbone

__all__ = ["set_patch_stride", "set_open_clip_patch_stride", "dilate_to_output_stride", "SegmentationTeacher",
           "create_segmentation_teacher", "segmentation_teacher_spec"]


def _strided_grid(k: int, stride: int, h: int, w: int) -> Tuple[int, Tuple[int, int]]:
    """(padding, grid) of a k x k patch embedding moved with ``stride`` over an h x w input."""
    if stride > k:
        raise ToolchainError(f"patch stride {stride} is larger than the patch size {k}: pixels would be skipped")
    pad = (k - stride) // 2
    return pad, ((h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1)


@torch.no_grad()
def set_patch_stride(vit: nn.Module, stride: int) -> nn.Module:
    """Change a timm ViT's patch-embedding stride in place and resample its position embeddings."""
    from timm.layers import resample_abs_pos_embed

    pe = getattr(vit, "patch_embed", None)
    if pe is None or not hasattr(pe, "proj") or getattr(vit, "pos_embed", None) is None:
        raise ToolchainError("the segmentation form needs a timm ViT with absolute position embeddings "
                             "(e.g. timm:vit_large_patch14_dinov2.lvd142m)")
    old_grid = tuple(pe.grid_size)
    pad, new_grid = _strided_grid(pe.patch_size[0], stride, *pe.img_size)
    pe.proj.stride, pe.proj.padding = (stride, stride), (pad, pad)
    pe.grid_size, pe.num_patches = new_grid, new_grid[0] * new_grid[1]
    prefix = 0 if getattr(vit, "no_embed_class", False) else vit.num_prefix_tokens
    vit.pos_embed = nn.Parameter(resample_abs_pos_embed(vit.pos_embed.data, list(new_grid), list(old_grid),
                                                        num_prefix_tokens=prefix))
    return vit


@torch.no_grad()
def set_open_clip_patch_stride(visual: nn.Module, stride: int) -> nn.Module:
    """The same as :func:`set_patch_stride` for an open_clip ``VisionTransformer`` (``conv1`` +
    ``positional_embedding`` of shape (1 + grid, width))."""
    from timm.layers import resample_abs_pos_embed

    old_grid = tuple(visual.grid_size)
    size = visual.image_size
    pad, new_grid = _strided_grid(visual.conv1.kernel_size[0], stride,
                                  *(size if isinstance(size, (tuple, list)) else (size, size)))
    visual.conv1.stride, visual.conv1.padding = (stride, stride), (pad, pad)
    pos = resample_abs_pos_embed(visual.positional_embedding.data[None], list(new_grid), list(old_grid),
                                 num_prefix_tokens=1)[0]
    visual.positional_embedding = nn.Parameter(pos, requires_grad=visual.positional_embedding.requires_grad)
    visual.grid_size = new_grid
    return visual


@torch.no_grad()
def dilate_to_output_stride(net: nn.Module, features: Callable[[torch.Tensor], torch.Tensor], stride: int,
                            probe_size: int = 256) -> nn.Module:
    """Make a ConvNet's feature map input / ``stride`` by atrous convolution, in place.

    A probe forward measures the stride s at which each layer's input arrives.  A strided layer that would
    take the map below 1 / ``stride`` runs at stride 1, and every convolution whose input was at s > stride
    is dilated by s / stride (so the layer whose stride was removed keeps its dilation and the ones after it
    double it, as in DeepLab)."""
    layers = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d))]
    seen = {}

    def record(m, inp, out):  # returns None: the output passes unchanged
        seen.setdefault(m, probe_size / inp[0].shape[-1])

    hooks = [m.register_forward_hook(record) for m in layers]
    was = net.training
    try:
        net.eval()
        out = features(torch.zeros(1, 3, probe_size, probe_size))
    finally:
        for h in hooks:
            h.remove()
        net.train(was)
    now = probe_size / out.shape[-1]
    if now < stride:
        raise ToolchainError(f"this backbone's feature map is already at stride {now:g}, below {stride}")
    for m in layers:
        s_in = seen.get(m)
        if s_in is None:  # not on the feature path (e.g. a classifier's pooling)
            continue
        own = m.stride if isinstance(m.stride, int) else m.stride[0]
        if own > 1 and s_in * own > stride:
            if isinstance(m, nn.AvgPool2d):  # a shortcut's 2x2 average pool: at stride 1 it pools nothing
                m.kernel_size, m.stride, m.padding = 1, 1, 0
                continue
            m.stride = 1 if isinstance(m, nn.MaxPool2d) else (1, 1)
        rate = int(round(s_in / stride))
        if isinstance(m, nn.Conv2d) and rate > 1 and m.kernel_size[0] > 1:
            k, d = m.kernel_size[0], m.dilation[0]
            if m.padding != ((k - 1) // 2 * d,) * 2:
                raise ToolchainError(f"cannot dilate a {k}x{k} convolution with padding {m.padding}: only 'same'-"
                                     f"padded ConvNets reach output stride {stride} this way")
            m.dilation = (d * rate, d * rate)
            m.padding = ((k - 1) // 2 * d * rate,) * 2
    return net


class SegmentationTeacher(nn.Module):
    """``kind``: ``vit`` (timm), ``open_clip`` or ``cnn``; it says how the feature grid is read."""

    def __init__(self, backbone: nn.Module, num_classes: int, kind: str = "vit", channels: Optional[int] = None):
        super().__init__()
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead

        self.backbone, self.kind = backbone, kind
        self.head = DeepLabHead(channels or backbone.num_features, num_classes)

    def net(self) -> nn.Module:
        model = self.backbone.model
        return getattr(model, "model", model)  # inside an adapter wrapper (PEFT LoraModel) or not

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # (B, D, H/s, W/s)
        net = self.net()
        if self.kind == "cnn":
            return _cnn_features(net)(x)
        if self.kind == "open_clip":
            visual = net.visual
            visual.output_tokens = True
            try:
                _, tokens = visual(x)                                  # (B, gh*gw, D) after ln_post
            finally:
                visual.output_tokens = False
            gh, gw = visual.grid_size
            return tokens.transpose(1, 2).reshape(x.shape[0], -1, gh, gw)
        tokens = net.forward_features(x)                               # (B, N, D)
        gh, gw = net.patch_embed.grid_size
        patches = tokens[:, net.num_prefix_tokens:]                    # (B, gh*gw, D)
        return patches.transpose(1, 2).reshape(x.shape[0], -1, gh, gw)

    def forward_logits(self, x: torch.Tensor) -> torch.Tensor:        # (B, C, H/s, W/s), before upsampling
        return self.head(self.forward_features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (B, C, H, W)
        return F.interpolate(self.forward_logits(x), size=x.shape[-2:], mode="bilinear", align_corners=False)


def _cnn_features(net: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The last feature map of a ConvNet: timm's ``forward_features``, torchvision's ``features``."""
    if hasattr(net, "forward_features"):
        return net.forward_features
    if isinstance(getattr(net, "features", None), nn.Module):
        return net.features
    raise ToolchainError(f"{type(net).__name__} exposes no feature map (torchvision models with .features such "
                         f"as mobilenet_v2 / efficientnet / convnext, or any timm ConvNet, e.g. timm:resnet50)")


def _kind(name: str, backbone) -> str:
    if name.startswith("open_clip:"):
        if not hasattr(backbone.model.visual, "conv1"):
            raise ToolchainError(f"'{name}': only open_clip ViT towers have a patch grid for segmentation")
        return "open_clip"
    return "vit" if hasattr(backbone.model, "patch_embed") and getattr(backbone.model, "pos_embed", None) \
        is not None else "cnn"


def create_segmentation_teacher(name: str, weights: str, image_size: Optional[int], num_classes: int,
                                adapter: AdapterConfig, stride: int = 8) -> SegmentationTeacher:
    backbone = create_backbone(name, weights, image_size)
    kind = _kind(name, backbone)
    channels = None
    if kind == "vit":
        set_patch_stride(backbone.model, stride)
    elif kind == "open_clip":
        visual = backbone.model.visual
        set_open_clip_patch_stride(visual, stride)
        channels = visual.conv1.out_channels  # tokens before the projection
    else:
        features = _cnn_features(backbone.model)
        dilate_to_output_stride(backbone.model, features, stride, 256)
        with torch.no_grad():
            channels = int(features(torch.zeros(1, 3, 8 * stride, 8 * stride)).shape[1])
    backbone = apply_adapter(backbone, adapter)
    if isinstance(backbone.model, ThenAdapter):
        raise ToolchainError(f"adapter '{adapter.name}' changes the pooled embedding, which a segmentation teacher "
                             f"does not use; choose lora, full, linear or a block adapter")
    return SegmentationTeacher(backbone, num_classes, kind, channels)


def segmentation_teacher_spec(name: str, image_size: Optional[int], classes, adapter: AdapterConfig, preprocess,
                              stride: int = 8) -> dict:
    return {"family": "segmentation_teacher", "name": name, "image_size": image_size, "num_classes": len(classes),
            "output_stride": stride,
            "classes": list(classes), "adapter": adapter.model_dump(mode="json"), "preprocess": preprocess.to_dict(),
            "task": "segmentation"}


@MODEL_FAMILIES.register("segmentation_teacher")
def build_segmentation_teacher_from_spec(spec: dict) -> SegmentationTeacher:
    from vfm_toolchain.data.images import Preprocess

    model = create_segmentation_teacher(spec["name"], "none", spec["image_size"], spec["num_classes"],
                                        AdapterConfig(**spec["adapter"]), spec.get("output_stride", 8))
    model.backbone.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model
