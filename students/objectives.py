"""Knowledge-transfer objectives (seed 004 sec. 2 and 3.1), one registry, selected by ``distill.mode`` /
``distill.features``.

Each objective is a module that owns the student and whatever it trains beside it (projections, a
contrastive temperature), so one optimizer and one checkpoint cover all of it.  ``target(raw)`` turns the
teacher's raw output into what is cached per (image, view), so cached and online teaching compute the
same loss; ``forward(x, target)`` returns the loss of a batch.

- ``task_oriented``: KL between temperature-softened softmaxes of the finetuned teacher and the student.
- ``global_contrastive``: pooled student features vs the frozen VFM's global features through linear
  projections (both models for DINOv2-like teachers, the student only for OpenCLIP), CLIP's symmetric
  InfoNCE loss with a learned temperature.
- ``patch_cosine``: the student's last feature map through a 1x1 projection vs the VFM's patch grid
  resized to the student's map, 1 - cosine similarity per position.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from students.losses import kl_distillation
from toolchain.registry import Registry

__all__ = ["OBJECTIVES", "TaskOriented", "GlobalContrastive", "PatchCosine", "student_map_size",
           "pooled_features"]

OBJECTIVES = Registry("objective")


def pooled_features(student: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm students: the pooled features the linear head reads (seed 004 A.1); segmentation students:
    their feature map, averaged."""
    if hasattr(student, "pooled"):
        return student.pooled(x)
    return student.forward_head(student.forward_features(x), pre_logits=True)


@torch.no_grad()
def student_map_size(student: nn.Module, image_size: int) -> Tuple[int, int, int]:
    """(channels, h, w) of the student's last feature map at ``image_size``."""
    was = student.training
    student.eval()
    f = student.forward_features(torch.zeros(1, 3, image_size, image_size))
    student.train(was)
    return int(f.shape[1]), int(f.shape[2]), int(f.shape[3])


@OBJECTIVES.register("task_oriented", teacher="finetuned", source="seed 004 sec. 2, Fig. 1b")
class TaskOriented(nn.Module):
    """Per image, or per pixel for segmentation (the teacher's logit map resized to the student's output)."""

    def __init__(self, student: nn.Module, temperature: float = 4.0, student_size: int = 0, **_):
        super().__init__()
        self.student, self.temperature, self.size = student, temperature, student_size

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.ndim == 4:  # (B, C, H, W) logit maps, cached in half precision
            return F.interpolate(raw.float(), size=(self.size, self.size), mode="bilinear", align_corners=False).half()
        return raw.float()  # logits

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_distillation(self.student(x), target.float(), self.temperature)


@OBJECTIVES.register("global_contrastive", teacher="frozen VFM", source="seed 004 sec. 3.1, Fig. 1d")
class GlobalContrastive(nn.Module):
    """``teacher_projection=False`` (OpenCLIP): the student is projected into the teacher's embedding space."""

    def __init__(self, student: nn.Module, teacher_dim: int, projection_dim: int = 256,
                 teacher_projection: bool = True, **_):
        super().__init__()
        self.student = student
        out = projection_dim if teacher_projection else teacher_dim
        self.student_proj = nn.Linear(student.num_features, out)
        self.teacher_proj = nn.Linear(teacher_dim, out) if teacher_projection else nn.Identity()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.float()  # pooled / CLS features

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = F.normalize(self.student_proj(pooled_features(self.student, x)), dim=-1)
        t = F.normalize(self.teacher_proj(target), dim=-1)
        logits = self.logit_scale.clamp(max=math.log(100)).exp() * s @ t.t()
        labels = torch.arange(len(x), device=x.device)
        return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


@OBJECTIVES.register("patch_cosine", teacher="frozen VFM", source="seed 004 sec. 3.1 (DINOv2 patch features)")
class PatchCosine(nn.Module):
    def __init__(self, student: nn.Module, teacher_dim: int, student_map: Tuple[int, int, int], **_):
        super().__init__()
        self.student = student
        self.size = student_map[1:]
        self.student_proj = nn.Conv2d(student_map[0], teacher_dim, 1)

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        """The teacher's patch grid resized to the student's feature map (cached in half precision)."""
        return F.interpolate(raw.float(), size=self.size, mode="bilinear", align_corners=False).half()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = self.student_proj(self.student.forward_features(x))
        return (1 - F.cosine_similarity(s, target.float(), dim=1)).mean()
