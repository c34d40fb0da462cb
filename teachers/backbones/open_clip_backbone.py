"""OpenCLIP image towers as teachers: ``open_clip:ViT-L-14/datacomp_xl_s13b_b90k`` (ARCH/PRETRAINED_TAG)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vfm_toolchain.checkpoint import load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import did_you_mean
from vfm_toolchain.data.images import ImageSize, Preprocess, image_hw
from vfm_toolchain.devices import inference_autocast, on_device
from vfm_toolchain.teachers.backbones.base import BACKBONES, Backbone, InputGeometry, tokens_to_grid
from vfm_toolchain.teachers.backbones.timm_backbone import timm_geometry


class _ImageTower(nn.Module):
    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.visual(x)
        return out[0] if isinstance(out, tuple) else out  # (B, D) projected CLS embedding


def check_open_clip_name(spec: str, weights: Optional[str]) -> None:
    """``ARCH[/TAG]`` is an open_clip model, and 'pretrained' weights name one of its tags."""
    import open_clip

    arch, _, tag = spec.partition("/")
    names = open_clip.list_models()
    if arch not in names:
        raise ToolchainError(f"unknown open_clip model '{arch}'.{did_you_mean(arch, names)} The names are "
                             f"open_clip.list_models(), written open_clip:ARCH/TAG, e.g. "
                             f"open_clip:ViT-L-14/datacomp_xl_s13b_b90k")
    if weights != "pretrained":
        return
    tags = open_clip.list_pretrained_tags_by_model(arch)
    shown = (", ".join(tags[:12]) + (f", ... ({len(tags)} in all: open_clip.list_pretrained_tags_by_model('{arch}'))"
                                       if len(tags) > 12 else "")) or "none (use weights none or a local checkpoint)"
    if not tag:
        raise ToolchainError(f"open_clip:{arch} needs a pretrained tag (open_clip:{arch}/TAG); tags: {shown}")
    if tag.lower().replace("-", "_") not in tags:  # open_clip's own spelling rule for tags
        raise ToolchainError(f"open_clip model '{arch}' has no pretrained tag '{tag}'.{did_you_mean(tag, tags)} Its "
                             f"tags: {shown}")


def open_clip_geometry(spec: str, weights: Optional[str] = None) -> InputGeometry:
    """The image tower's input size and patch size, from open_clip's model config (nothing is built)."""
    import open_clip

    check_open_clip_name(spec, weights)
    vision = (open_clip.get_model_config(spec.partition("/")[0]) or {}).get("vision_cfg", {})
    default = image_hw(vision["image_size"]) if vision.get("image_size") else None
    if vision.get("timm_model_name"):  # a timm tower: its own patch size; no conv1 grid for segmentation
        try:
            patch = timm_geometry(vision["timm_model_name"]).patch
        except ToolchainError:  # a tower this timm does not have: building the model says so
            patch = None
        return InputGeometry(default, patch, no_segmentation="only open_clip's own ViT towers have the patch grid "
                             f"the segmentation form reads (this tower is timm's {vision['timm_model_name']})")
    if not vision.get("patch_size") or not isinstance(vision.get("layers"), int):  # ModifiedResNet (RN50, ...)
        return InputGeometry(default, no_segmentation="only open_clip ViT towers have a patch grid for "
                                                      "segmentation; use a ViT (e.g. open_clip:ViT-B-16/TAG)")
    return InputGeometry(default, image_hw(vision["patch_size"]))


@BACKBONES.register("open_clip:", library="open_clip", example="open_clip:ViT-L-14/datacomp_xl_s13b_b90k",
                    geometry=open_clip_geometry, text_tower=True)
def create_open_clip_backbone(spec: str, weights: Optional[str], image_size: Optional[ImageSize]) -> Backbone:
    import open_clip

    check_open_clip_name(spec, weights)
    arch, _, tag = spec.partition("/")
    pretrained = tag if weights == "pretrained" else None
    if weights not in (None, "pretrained"):
        load_state_dict_safely(weights)  # our safety check and message first
        pretrained = weights  # open_clip accepts a local checkpoint path here
    kwargs = {}
    if image_size:
        h, w = image_hw(image_size)
        vision = (open_clip.get_model_config(arch) or {}).get("vision_cfg", {})
        if h != w and isinstance(vision.get("layers"), (list, tuple)):
            raise ToolchainError(f"open_clip '{arch}' is a ResNet tower, whose attention pool has a fixed square grid: "
                                 f"image_size {h}x{w} is not square; use one side, e.g. image_size: {max(h, w)}")
        # ViT towers take (h, w); ResNet towers only an int (their attention pool's grid is image_size // 32)
        kwargs["force_image_size"] = h if h == w else (h, w)
    try:
        model = open_clip.create_model(arch, pretrained=pretrained, **kwargs)
    except Exception as exc:
        raise ToolchainError(f"could not load open_clip '{spec}' with weights '{weights}': {exc}. Offline? "
                             f"Pass a local checkpoint path as teacher.weights.") from None
    visual = model.visual
    pp = Preprocess(image_hw(visual.image_size),
                    tuple(getattr(visual, "image_mean", None) or open_clip.OPENAI_DATASET_MEAN),
                    tuple(getattr(visual, "image_std", None) or open_clip.OPENAI_DATASET_STD), "bicubic")
    backbone = Backbone(_ImageTower(visual), int(visual.output_dim), pp)
    if hasattr(visual, "output_tokens"):  # ViT towers: the patch tokens before the final projection
        def patches(x):
            visual.output_tokens = True
            try:
                _, tokens = visual(x)
            finally:
                visual.output_tokens = False
            return tokens_to_grid(tokens, 0)

        backbone.patch_fn = patches
    tokenizer = open_clip.get_tokenizer(arch)

    @torch.no_grad()
    def encode_text(texts):
        """(T, D) unit-norm text embeddings on the CPU, computed on the build's device (a ViT-L text tower over
        ~80 templates per class is slow on a CPU); the text tower stays outside the teacher's state dict."""
        model.eval()
        with on_device(model) as device, inference_autocast():
            out = model.encode_text(tokenizer(list(texts)).to(device))
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu()

    backbone.encode_text = encode_text
    backbone.logit_scale = float(model.logit_scale.exp().item())
    return backbone
