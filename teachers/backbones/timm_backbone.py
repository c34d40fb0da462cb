"""Any timm model as a teacher: DINOv2 (``timm:vit_large_patch14_dinov2.lvd142m``), ConvNets, ..."""
from __future__ import annotations

from typing import Optional

import timm
import torch

from vfm_toolchain.checkpoint import load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import did_you_mean
from vfm_toolchain.data.images import ImageSize, Preprocess, image_hw
from vfm_toolchain.teachers.backbones.base import BACKBONES, Backbone, InputGeometry, tokens_to_grid


def check_timm_name(arch: str, weights: Optional[str]) -> None:
    """``arch`` (with its optional ``.tag``) is a timm model, and has the pretrained weights asked for."""
    base, _, tag = arch.partition(".")
    names = timm.list_models()
    if base not in names:
        raise ToolchainError(f"unknown timm model '{arch}'.{did_you_mean(base, names)} The names are "
                             f"timm.list_models(), e.g. vit_small_patch14_dinov2.lvd142m")
    if weights != "pretrained":
        return
    tags = timm.list_pretrained(f"{base}.*")
    if tag and arch not in tags:
        raise ToolchainError(f"timm model '{base}' has no pretrained tag '{tag}'.{did_you_mean(arch, tags)} Its "
                             f"tags: {', '.join(t.split('.', 1)[1] for t in tags) or 'none'}")
    if not tags and base not in timm.list_pretrained():
        raise ToolchainError(f"timm model '{base}' has no pretrained weights; use weights 'none' or a local "
                             f"checkpoint, or a model with weights (timm.list_pretrained())")


def timm_geometry(arch: str, weights: Optional[str] = None) -> InputGeometry:
    """The default input size and ViT patch size of a timm model, built on the meta device (no memory, no
    weights; about 0.1 s even for a ViT-L)."""
    check_timm_name(arch, weights)
    try:
        with torch.device("meta"):
            model = timm.create_model(arch, pretrained=False, num_classes=0)
    except Exception:  # an architecture that cannot be built on the meta device: its stage checks it
        return InputGeometry()
    default = tuple(timm.data.resolve_data_config({}, model=model)["input_size"][1:])
    pe = getattr(model, "patch_embed", None)
    patch = getattr(pe, "patch_size", None)
    if patch is None or getattr(pe, "dynamic_img_pad", False):  # ConvNets, or a ViT that pads any size itself
        return InputGeometry(default)
    return InputGeometry(default, tuple(image_hw(patch)))


@BACKBONES.register("timm:", library="timm", example="timm:vit_small_patch14_dinov2.lvd142m", geometry=timm_geometry)
def create_timm_backbone(arch: str, weights: Optional[str], image_size: Optional[ImageSize]) -> Backbone:
    check_timm_name(arch, weights)
    kwargs = {"num_classes": 0}
    overlay = None
    if weights not in (None, "pretrained"):
        load_state_dict_safely(weights)  # refuse unsafe files with our message before timm reads them
        overlay = {"file": weights}
    try:
        model = _create(arch, weights is not None, overlay, image_size, kwargs)
    except ToolchainError:
        raise
    except Exception as exc:  # network errors from the hub, shape errors from a wrong checkpoint
        raise ToolchainError(f"could not load timm model '{arch}' with weights '{weights}': {exc}. Offline? "
                             f"Pass a local checkpoint path as teacher.weights.") from None
    cfg = timm.data.resolve_data_config({}, model=model)
    size = image_size or tuple(cfg["input_size"][1:])
    pp = Preprocess(size, tuple(cfg["mean"]), tuple(cfg["std"]), cfg.get("interpolation", "bilinear"))
    backbone = Backbone(model, model.num_features, pp)
    backbone.patch_fn = lambda x: _timm_patches(model, x)
    return backbone


def _timm_patches(model, x):
    f = model.forward_features(x)
    if f.ndim == 4:  # ConvNets: already a map (B, C, h, w)
        return f
    return tokens_to_grid(f, getattr(model, "num_prefix_tokens", 1))


def _create(arch, pretrained, overlay, image_size, kwargs):
    extra = {"pretrained_cfg_overlay": overlay} if overlay else {}
    if image_size is not None:
        try:  # ViTs take img_size, (h, w) included (and resample position embeddings); ConvNets do not need it
            return timm.create_model(arch, pretrained=pretrained, img_size=image_hw(image_size), **extra, **kwargs)
        except TypeError:
            pass
    return timm.create_model(arch, pretrained=pretrained, **extra, **kwargs)
