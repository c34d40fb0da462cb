"""Distillation losses, registered by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vfm_toolchain.core.registry import Registry

__all__ = ["LOSSES", "kl_distillation", "bernoulli_kl", "quality_focal_loss"]

LOSSES = Registry("loss")


@LOSSES.register("kl", source="Hinton et al.; seed 004 sec. 3.1 (task-oriented transfer)")
def kl_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(t/T) || softmax(s/T)) * T^2, averaged over the batch (and pixels, if any)."""
    t = temperature
    log_p_s = F.log_softmax(student_logits / t, dim=1)
    log_p_t = F.log_softmax(teacher_logits / t, dim=1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1)
    return kl.mean() * t * t


@LOSSES.register("bernoulli_kl", source="per-location sigmoid outputs (detection quality)")
def bernoulli_kl(student_logits: torch.Tensor, teacher_prob: torch.Tensor) -> torch.Tensor:
    """Elementwise KL(Bernoulli(t) || Bernoulli(sigmoid(s))): the BCE against the soft target minus the target's
    own entropy, so it is 0 where the student matches the teacher (a plain BCE never is for 0 < t < 1)."""
    t = teacher_prob.clamp(1e-6, 1 - 1e-6)
    entropy = -(t * t.log() + (1 - t) * (1 - t).log())
    return F.binary_cross_entropy_with_logits(student_logits, t, reduction="none") - entropy


@LOSSES.register("quality_focal", source="Li et al., Generalized Focal Loss (2020): QFL with soft targets")
def quality_focal_loss(student_logits: torch.Tensor, teacher_prob: torch.Tensor, beta: float = 2.0) -> torch.Tensor:
    """Elementwise quality focal loss: BCE against the teacher's probability, scaled by |sigmoid(s) - t|^beta.
    The scale is the focal loss's idea for soft targets: the tens of thousands of background locations the
    student already reads as the teacher does add almost nothing, and the loss is 0 where the two agree."""
    scale = (student_logits.sigmoid() - teacher_prob).abs().pow(beta)
    return F.binary_cross_entropy_with_logits(student_logits, teacher_prob, reduction="none") * scale
