"""Detection students: every registered student (MobileViT-V2, FastViT, MobileNetV4, RepViT, EfficientViT,
``timm:<any>``) with the teacher's FPN neck and FCOS head (blocks/detection.py) at strides 8 / 16 / 32.

The same head layout and strides as the teacher put the student's locations exactly on the teacher's, so
the teacher's dense outputs are per-location targets without any resampling (the reason for FCOS, see
blocks/detection.py).

Hierarchical students are built with ``timm.create_model(features_only=True, out_indices=...)``, the indices
being the last ``feature_info`` entry at each of the three strides (read from the architecture built on the
meta device: no memory, no weights).  ``features_only`` keeps timm's own modules (with flattened names), so
FastViT's and RepViT's ``reparameterize`` methods and the Conv + BatchNorm pairs are where the export floor's
fold passes (``students/fold.py``) look for them.  A plain timm model (a ViT as ``timm:vit_*``) gets the
teacher's simple feature pyramid instead.

Input sides must be multiples of 32, and of 64 for MobileViT-V2: its last stage pads an odd grid up to the
patch size, which would move the stride-32 locations off the teacher's.
"""
from __future__ import annotations

from typing import Any, Dict

import timm
import torch

from vfm_toolchain.blocks.detection import (STRIDES, Detector, FeatureReader, SimpleFeaturePyramid,
                                            last_index_per_stride, timm_feature_plan)
from vfm_toolchain.checkpoint import MODEL_FAMILIES, load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.students.models import STUDENTS, check_timm_name

__all__ = ["build_student_detector", "detection_student_spec", "student_detection_multiple"]


def build_student_detector(name: str, num_classes: int, weights: str = "none", neck_channels: int = 96,
                           head_convs: int = 2, head_norm: str = "group") -> Detector:
    """A registered student's backbone under the FPN neck and FCOS head.

    Args:
        name: a name of ``STUDENTS`` (``mobilevitv2_050``, ``fastvit_t8``, ..., ``timm:<model>``).
        weights: ``none``, ``pretrained`` (timm's hub) or a local checkpoint of the classification model (its
            classifier is dropped); only the backbone takes them, the neck and head start fresh.
        head_norm: ``group`` (FCOS's GroupNorm) or ``batch`` (a BatchNorm per level, folded away on export).

    Raises:
        ToolchainError: unknown student, a checkpoint that does not fit, no feature maps to read.
    """
    arch = check_timm_name(name)
    extra: Dict[str, Any] = {}
    pretrained = weights != "none"
    if weights not in ("none", "pretrained"):
        load_state_dict_safely(weights)  # refuse unsafe files with our message before timm reads them
        extra["pretrained_cfg_overlay"] = {"file": weights}
    try:
        with torch.device("meta"):  # the architecture's feature_info, without memory or weights
            probe = timm.create_model(arch, pretrained=False, features_only=True)
        picked = last_index_per_stride(probe.feature_info.reduction(), STRIDES)
    except Exception:  # no features_only form (timm raises its own errors for those): read the model whole
        picked = None
    try:
        if picked is not None:
            out_indices = tuple(probe.feature_info.out_indices[i] for i in picked)
            body = timm.create_model(arch, pretrained=pretrained, features_only=True, out_indices=out_indices,
                                     **extra)
            reader, channels, plain_stride = FeatureReader("timm_features"), body.feature_info.channels(), None
        else:
            body = _plain_body(arch, pretrained, extra)
            reader, channels, plain_stride = timm_feature_plan(body)
    except ToolchainError:
        raise
    except Exception as exc:  # offline hub, a checkpoint of another architecture
        raise ToolchainError(f"could not build detection student '{name}' with weights '{weights}': {exc}") from None
    pyramid = SimpleFeaturePyramid(channels[0], plain_stride) if plain_stride else None
    return Detector(body, reader, pyramid.channels if pyramid else channels, num_classes, pyramid=pyramid,
                    neck_channels=neck_channels, head_convs=head_convs, head_norm=head_norm)


def _plain_body(arch: str, pretrained: bool, extra: Dict[str, Any]) -> torch.nn.Module:
    """A plain timm model (ViT) without its classifier; with ``dynamic_img_size`` where the model takes it, since
    a student is built before its input size is known and a ViT's position embeddings fix one otherwise."""
    try:
        return timm.create_model(arch, pretrained=pretrained, num_classes=0, dynamic_img_size=True, **extra)
    except TypeError:
        return timm.create_model(arch, pretrained=pretrained, num_classes=0, **extra)


def detection_student_spec(name: str, classes, preprocess: Preprocess, neck_channels: int = 96,
                           head_convs: int = 2, head_norm: str = "group") -> Dict[str, Any]:
    return {"family": "detection_student", "name": name, "num_classes": len(classes), "classes": list(classes),
            "preprocess": preprocess.to_dict(), "reparameterizable": STUDENTS.meta(name)["reparameterizable"],
            "neck_channels": neck_channels, "head_convs": head_convs, "head_norm": head_norm, "task": "detection"}


@MODEL_FAMILIES.register("detection_student")
def build_detection_student_from_spec(spec: Dict[str, Any]) -> Detector:
    model = build_student_detector(spec["name"], spec["num_classes"], "none", spec.get("neck_channels", 96),
                                   spec.get("head_convs", 2), spec.get("head_norm", "group"))
    model.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model


def student_detection_multiple(name: str) -> int:
    """The multiple each input side must be for ``name``'s detector: 64 for MobileViT (V1 and V2, whose last
    stage pads an odd grid), else 32."""
    return 64 if check_timm_name(name).startswith("mobilevit") else 32
