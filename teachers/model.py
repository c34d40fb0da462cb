"""The teacher: a backbone (with its adapter) and a linear head on the pooled / CLS features."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from vfm_toolchain.blocks.norm import keep_norm_frozen
from vfm_toolchain.checkpoint import MODEL_FAMILIES
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.teachers.adapters import apply_adapter, fold_adapter
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.embed import embed_backbone

__all__ = ["TeacherClassifier", "create_teacher", "teacher_spec"]


class TeacherClassifier(nn.Module):
    def __init__(self, backbone: nn.Module, num_classes: int, freeze_norm: bool, normalize: bool = False):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, num_classes)
        self.freeze_norm = freeze_norm  # adapters that freeze the backbone also freeze its BN statistics
        self.normalize = normalize  # CLIP-style: the head sees unit-norm embeddings (zero-shot head)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x)  # (B, D)
        return torch.nn.functional.normalize(f, dim=-1) if self.normalize else f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))  # (B, C)

    def get_classifier(self) -> nn.Linear:  # timm's name, so toolchain.probe fits this head too
        return self.head

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.freeze_norm:
            keep_norm_frozen(self.backbone)
        return self


def teacher_spec(name: str, image_size: Optional[int], num_classes: int, adapter: AdapterConfig,
                 preprocess: Preprocess, classes, normalize: bool = False) -> Dict[str, Any]:
    return {"family": "teacher", "name": name, "image_size": image_size, "num_classes": num_classes,
            "adapter": adapter.model_dump(mode="json"), "preprocess": preprocess.to_dict(), "classes": list(classes),
            "normalize": normalize}


def create_teacher(name: str, weights: str, image_size: Optional[int], num_classes: int,
                   adapter: AdapterConfig, normalize: bool = False) -> TeacherClassifier:
    backbone = apply_adapter(create_backbone(name, weights, image_size), adapter)
    return TeacherClassifier(backbone, num_classes, freeze_norm=adapter.name != "full", normalize=normalize)


@torch.no_grad()
def zero_shot_text_embeddings(backbone: nn.Module, classes: List[str], prompts: Optional[List[str]],
                              what: str) -> torch.Tensor:
    """(C, D) unit rows: each class name in every template, through the text tower, averaged."""
    from vfm_toolchain.core.errors import ToolchainError

    encode = getattr(backbone, "encode_text", None)
    if encode is None:
        raise ToolchainError(f"{what} needs an open_clip model with a text tower (open_clip:ARCH/TAG)")
    if prompts is None:
        from open_clip import OPENAI_IMAGENET_TEMPLATES

        templates = [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]  # the templates are lambdas of the class name
    else:
        templates = prompts
    bad = [t for t in templates if "{}" not in t]
    if bad:
        raise ToolchainError(f"{what}: every prompt template needs '{{}}' for the class name; got {bad[:3]}")
    rows = []
    for c in classes:
        name = c.replace("_", " ")
        emb = encode([t.replace("{}", name) for t in templates]).mean(0)
        rows.append(torch.nn.functional.normalize(emb, dim=0))
    return torch.stack(rows)


@torch.no_grad()
def init_zero_shot_head(model: TeacherClassifier, classes: List[str], prompts: Optional[List[str]]) -> None:
    """Head rows = logit_scale * the mean unit text embedding of each class name over the templates."""
    rows = zero_shot_text_embeddings(model.backbone, classes, prompts,
                                     "teacher.head_init 'zero_shot' (use 'random' for image-only backbones)")
    model.normalize = True
    model.head.weight.copy_(rows * getattr(model.backbone, "logit_scale", 100.0))
    model.head.bias.zero_()


@MODEL_FAMILIES.register("teacher")
def build_teacher_from_spec(spec: Dict[str, Any]) -> TeacherClassifier:
    model = create_teacher(spec["name"], "none", spec["image_size"], spec["num_classes"],
                           AdapterConfig(**spec["adapter"]), normalize=spec.get("normalize", False))
    model.backbone.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model


def fold_teacher(model: TeacherClassifier, spec: Dict[str, Any]) -> TeacherClassifier:
    """Fold the teacher's adapter into plain weights (raises for adapters that do not fold)."""
    model.backbone = fold_adapter(model.backbone, AdapterConfig(**spec["adapter"]))
    return model


def embed_features(model: TeacherClassifier, paths: List[str], pp: Preprocess,
                   batch_size: Union[int, str] = "auto", normalize: bool = False) -> torch.Tensor:
    """The teacher's embedding of images (what its head sees), optionally L2-normalised."""
    out = embed_backbone(model.backbone, paths, pp, batch_size)
    return torch.nn.functional.normalize(out, dim=1) if normalize else out
