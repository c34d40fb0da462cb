"""Distillation losses, registered by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vfm_toolchain.registry import Registry

__all__ = ["LOSSES", "kl_distillation"]

LOSSES = Registry("loss")


@LOSSES.register("kl", source="Hinton et al.; seed 004 sec. 3.1 (task-oriented transfer)")
def kl_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(t/T) || softmax(s/T)) * T^2, averaged over the batch (and pixels, if any)."""
    t = temperature
    log_p_s = F.log_softmax(student_logits / t, dim=1)
    log_p_t = F.log_softmax(teacher_logits / t, dim=1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=1)
    return kl.mean() * t * t
