"""The detection teacher (issue 38): the backbone with its adapter under the FPN neck and FCOS head of
blocks/detection.py, which says why FCOS and what each part is.  Backbone features at strides 8 / 16 / 32 are read
from whatever builds the backbone (teachers/backbones/), without rebuilding it, so the weights, the preprocessing
and any adapter (LoRA, blocks, ...) apply exactly as for the classification teacher."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from vfm_toolchain.blocks.detection import (Detector, FeatureReader, SimpleFeaturePyramid, open_clip_feature_plan,
                                            timm_feature_plan, torchvision_feature_plan)
from vfm_toolchain.checkpoint import MODEL_FAMILIES
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import ImageSize, Preprocess
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.teachers.adapters import apply_adapter
from vfm_toolchain.teachers.adapters.blocks import ThenAdapter
from vfm_toolchain.teachers.backbones import Backbone, create_backbone

__all__ = ["create_detection_teacher", "detection_teacher_spec"]


def _teacher_plan(name: str, backbone: Backbone) -> Tuple[FeatureReader, List[int], Optional[int]]:
    library = name.split(":", 1)[0]
    if library == "timm":
        return timm_feature_plan(backbone.model)
    if library == "torchvision":
        return (*torchvision_feature_plan(backbone.model), None)
    if library == "open_clip":
        return open_clip_feature_plan(backbone.model.visual)
    raise ToolchainError(f"teacher '{name}': detection reads feature maps from timm:, torchvision: and open_clip: "
                         f"backbones only")


def create_detection_teacher(name: str, weights: str, image_size: Optional[ImageSize], num_classes: int,
                             adapter: AdapterConfig, neck_channels: int = 96, head_convs: int = 2) -> Detector:
    """A registered teacher backbone (``timm:``, ``torchvision:``, ``open_clip:``) with its adapter, as the
    classification teacher applies it, under an FPN and the FCOS head.

    Raises:
        ToolchainError: a backbone without maps to read, or an adapter on the pooled embedding (CLIP-Adapter,
        LLU), which a detector does not use.
    """
    backbone = create_backbone(name, weights, image_size)
    reader, channels, plain_stride = _teacher_plan(name, backbone)
    backbone = apply_adapter(backbone, adapter)
    if isinstance(backbone.model, ThenAdapter):
        raise ToolchainError(f"adapter '{adapter.name}' changes the pooled embedding, which a detection teacher "
                             f"does not use; choose lora, full, linear or a block adapter")
    pyramid = SimpleFeaturePyramid(channels[0], plain_stride) if plain_stride else None
    return Detector(backbone, reader, pyramid.channels if pyramid else channels, num_classes, pyramid=pyramid,
                    neck_channels=neck_channels, head_convs=head_convs, freeze_norm=adapter.name != "full")


def detection_teacher_spec(name: str, image_size: Optional[ImageSize], classes, adapter: AdapterConfig,
                           preprocess: Preprocess, neck_channels: int = 96, head_convs: int = 2) -> Dict[str, Any]:
    return {"family": "detection_teacher", "name": name, "image_size": image_size, "num_classes": len(classes),
            "classes": list(classes), "adapter": adapter.model_dump(mode="json"), "preprocess": preprocess.to_dict(),
            "neck_channels": neck_channels, "head_convs": head_convs, "task": "detection"}


@MODEL_FAMILIES.register("detection_teacher")
def build_detection_teacher_from_spec(spec: Dict[str, Any]) -> Detector:
    model = create_detection_teacher(spec["name"], "none", spec["image_size"], spec["num_classes"],
                                     AdapterConfig(**spec["adapter"]), spec.get("neck_channels", 96),
                                     spec.get("head_convs", 2))
    model.backbone.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model
