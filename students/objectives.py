"""Knowledge-transfer objectives (seed 004 sec. 2 and 3.1), one registry, selected by ``distill.mode``,
``distill.features`` and ``distill.feature_loss``.

Each objective is a module that owns the student and whatever it trains beside it (projections, a
contrastive temperature, a memory of negatives), so one optimizer and one checkpoint cover all of it.
``target(raw)`` turns the teacher's raw output into what is cached per (image, view), in half precision,
so cached and online teaching compute the same loss; ``forward(x, target, index)`` returns the loss of a
batch (``index``: the transfer images' indices, which the contrastive memory needs).

- ``task_oriented``: KL between temperature-softened softmaxes of the finetuned teacher and the student;
  for segmentation per pixel, the teacher's logits kept at its own output resolution (stride 8) and
  upsampled inside the loss to the student's output, which is what the teacher's own forward does.
- ``global_contrastive``: pooled student features vs the frozen VFM's global features through linear
  projections (both models for DINOv2-like teachers, the student only for OpenCLIP), CLIP's symmetric
  InfoNCE loss with a learned temperature; ``negatives`` > 0 adds a memory of earlier batches' teacher
  features as further negatives (the teacher is frozen, so they are never stale: only their projection
  is recomputed), leaving out entries of images in the batch.
- ``global_regression``: the pooled student features through a linear projection regress the frozen VFM's
  global features (cosine, or smooth-L1 on vectors scaled to unit RMS): every dimension is matched, which
  a contrastive loss over a batch does not ask for.
- ``patch_regression``: the student's last feature map through a 1x1 projection vs the VFM's patch grid
  resized to the student's map, cosine (seed 004's choice) or smooth-L1 per position.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vfm_toolchain.core.registry import Registry
from vfm_toolchain.students.losses import kl_distillation

__all__ = ["OBJECTIVES", "TaskOriented", "task_oriented_loss", "GlobalContrastive", "GlobalRegression", "PatchRegression",
           "student_map_size", "pooled_features"]

OBJECTIVES = Registry("objective")


def pooled_features(student: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm students: the pooled features the linear head reads (seed 004 A.1); segmentation students:
    their feature map, averaged."""
    if hasattr(student, "pooled"):
        return student.pooled(x)
    return student.forward_head(student.forward_features(x), pre_logits=True)


@torch.no_grad()
def student_map_size(student: nn.Module, image_hw: Tuple[int, int]) -> Tuple[int, int, int]:
    """(channels, h, w) of the student's last feature map at an input of ``image_hw`` (height, width)."""
    was = student.training
    student.eval()
    f = student.forward_features(torch.zeros(1, 3, *image_hw))
    student.train(was)
    return int(f.shape[1]), int(f.shape[2]), int(f.shape[3])


@OBJECTIVES.register("task_oriented", teacher="finetuned", source="seed 004 sec. 2, Fig. 1b")
class TaskOriented(nn.Module):
    """Per image, or per pixel for segmentation (the teacher's logit map resized to the student's output)."""

    def __init__(self, student: nn.Module, temperature: float = 4.0, **_):
        super().__init__()
        self.student, self.temperature = student, temperature

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.half()  # logits, or (B, C, h, w) logit maps at the teacher's own output resolution

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        return task_oriented_loss(self.student(x), target, self.temperature)


def task_oriented_loss(out: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """The task-oriented KL of the student's logits against the teacher's; a teacher's logit map at its own
    output resolution is resized to the student's first (what the teacher's own forward does)."""
    t = target.float()
    if t.ndim == 4 and t.shape[-2:] != out.shape[-2:]:
        t = F.interpolate(t, size=out.shape[-2:], mode="bilinear", align_corners=False)
    return kl_distillation(out, t, temperature)


def _regression_loss(s: torch.Tensor, t: torch.Tensor, loss: str, dim: int) -> torch.Tensor:
    """Mean over vectors along ``dim`` of 1 - cosine, or of smooth-L1 between the two scaled to unit RMS."""
    if loss == "cosine":
        return (1 - F.cosine_similarity(s, t, dim=dim)).mean()
    rms = lambda v: v / v.pow(2).mean(dim=dim, keepdim=True).clamp_min(1e-12).sqrt()  # noqa: E731
    return F.smooth_l1_loss(rms(s), rms(t))


@OBJECTIVES.register("global_contrastive", teacher="frozen VFM", source="seed 004 sec. 3.1, Fig. 1d")
class GlobalContrastive(nn.Module):
    """``teacher_projection=False`` (OpenCLIP): the student is projected into the teacher's embedding space."""

    def __init__(self, student: nn.Module, teacher_dim: int, projection_dim: int = 256,
                 teacher_projection: bool = True, negatives: int = 0, **_):
        super().__init__()
        self.student = student
        out = projection_dim if teacher_projection else teacher_dim
        self.student_proj = nn.Linear(student.num_features, out)
        self.teacher_proj = nn.Linear(teacher_dim, out) if teacher_projection else nn.Identity()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's initial temperature
        # the memory: raw teacher features of earlier batches and their image indices (-1: empty); saved with
        # the training state so a resumed run continues with the same negatives
        self.register_buffer("memory", torch.zeros(negatives, teacher_dim, dtype=torch.half))
        self.register_buffer("memory_index", torch.full((negatives,), -1, dtype=torch.long))
        self.register_buffer("memory_next", torch.zeros((), dtype=torch.long))

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.half()  # pooled / CLS features

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        s = F.normalize(self.student_proj(pooled_features(self.student, x)), dim=-1)
        t = F.normalize(self.teacher_proj(target.float()), dim=-1)
        scale = self.logit_scale.clamp(max=math.log(100)).exp()
        logits = scale * s @ t.t()
        labels = torch.arange(len(x), device=x.device)
        teacher_side = F.cross_entropy(logits.t(), labels)
        if len(self.memory) and index is not None:
            filled = self.memory_index >= 0
            if filled.any():
                m = F.normalize(self.teacher_proj(self.memory[filled].float()), dim=-1)
                extra = scale * s @ m.t()                                     # (B, M) further negatives
                # an image of this batch is already here, as its positive or an in-batch negative
                in_batch = torch.isin(self.memory_index[filled], index.to(x.device))
                logits = torch.cat([logits, extra.masked_fill(in_batch.view(1, -1), float("-inf"))], dim=1)
            self._remember(target.detach(), index.to(x.device))
        return 0.5 * (F.cross_entropy(logits, labels) + teacher_side)

    @torch.no_grad()
    def _remember(self, target: torch.Tensor, index: torch.Tensor) -> None:
        n, size = len(target), len(self.memory)
        if n >= size:
            target, index, n = target[-size:], index[-size:], size
        at = (self.memory_next + torch.arange(n, device=target.device)) % size
        self.memory[at] = target.half()
        self.memory_index[at] = index
        self.memory_next.copy_((self.memory_next + n) % size)


@OBJECTIVES.register("global_regression", teacher="frozen VFM",
                     source="this project: feature regression beside seed 004's contrastive objective")
class GlobalRegression(nn.Module):
    def __init__(self, student: nn.Module, teacher_dim: int, loss: str = "cosine", **_):
        super().__init__()
        self.student, self.loss = student, loss
        self.student_proj = nn.Linear(student.num_features, teacher_dim)

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.half()

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        return _regression_loss(self.student_proj(pooled_features(self.student, x)), target.float(), self.loss, 1)


@OBJECTIVES.register("patch_regression", teacher="frozen VFM", source="seed 004 sec. 3.1 (DINOv2 patch features)")
class PatchRegression(nn.Module):
    def __init__(self, student: nn.Module, teacher_dim: int, student_map: Tuple[int, int, int], loss: str = "cosine",
                 **_):
        super().__init__()
        self.student, self.loss = student, loss
        self.size = student_map[1:]
        self.student_proj = nn.Conv2d(student_map[0], teacher_dim, 1)

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        """The teacher's patch grid resized to the student's feature map (cached in half precision)."""
        return F.interpolate(raw.float(), size=self.size, mode="bilinear", align_corners=False).half()

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        s = self.student_proj(self.student.forward_features(x))
        return _regression_loss(s, target.float(), self.loss, 1)
