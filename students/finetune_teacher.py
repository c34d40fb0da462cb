"""``finetune.teacher_weight``: the finetuned teacher keeps teaching while the student learns the labels.

Finetuning a distilled student on a few labels alone pulls it towards what those labels can teach: on Aquarium two
students distilled from teachers 3.4 mAP50 points apart ended 0.1 apart after the same finetune (docs/results.md).
Hinton et al.'s knowledge distillation (and seed 004's task-oriented loss) trains on the labels *and* the teacher's
soft outputs at once; here the teacher sees the very batch the student trains on (the same crops, flips and
photometric changes, so its targets hold for those pixels) and its loss is added to the labels' with
``teacher_weight``:

- classification and segmentation: seed 004's task-oriented KL at ``distill.temperature`` (per pixel, the teacher's
  logit map resized to the student's output, as :func:`~students.objectives.task_oriented_loss` does for distillation);
- detection: the dense loss of distillation (:func:`~students.detection_distill.dense_detection_loss`: quality
  focal loss on the teacher's class probabilities, GIoU and quality where it is confident).

The teacher is the one the student was distilled from (``teacher.finetune``, an ensemble's mean, flip-averaged when
``distill.teacher_flip`` is on), run in eval mode without gradients on the training device."""
from __future__ import annotations

from typing import Callable, Dict, List, Union

import torch
import torch.nn.functional as F
from torch import nn

from vfm_toolchain import distributed
from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.data import Preprocess
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.students.detection_distill import dense_detection_loss, dense_targets
from vfm_toolchain.students.objectives import task_oriented_loss
from vfm_toolchain.students.teacher_flip import FlipAveraged, flip_averaged

__all__ = ["TeacherLoss", "teacher_view"]

Output = Union[torch.Tensor, Dict[str, List[torch.Tensor]]]


def teacher_view(x: torch.Tensor, student: Preprocess, teacher: Preprocess) -> torch.Tensor:
    """A batch normalised for the student, as the teacher's preprocessing would give it: the same pixels,
    renormalised with the teacher's mean and std and resized to its input size when the two differ."""
    if tuple(student.mean) != tuple(teacher.mean) or tuple(student.std) != tuple(teacher.std):
        s_mean, s_std, t_mean, t_std = (torch.tensor(v, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
                                        for v in (student.mean, student.std, teacher.mean, teacher.std))
        x = ((x * s_std + s_mean) - t_mean) / t_std
    if tuple(x.shape[-2:]) != tuple(teacher.hw):
        x = F.interpolate(x, size=teacher.hw, mode="bilinear", align_corners=False, antialias=True)
    return x


class TeacherLoss:
    """``loss(x, student_output)``: ``weight`` times the distillation loss of the student's output on the batch
    ``x`` (normalised for the student) against the teacher's on the same batch."""

    def __init__(self, teacher: nn.Module, task: str, student_pp: Preprocess, weight: float, temperature: float,
                 flip: bool = False, flatten: Callable[[Output], Dict[str, torch.Tensor]] = None,
                 num_classes: int = 0):
        if task == "detection" and flatten is None:
            raise ValueError("a detection TeacherLoss needs the student's flatten (Detector.flatten)")
        self.task, self.weight, self.temperature = task, weight, temperature
        self.student_pp, self.teacher_pp = student_pp, teacher.backbone.preprocess
        if task == "detection" and tuple(self.teacher_pp.hw) != tuple(student_pp.hw):
            raise ToolchainError(f"finetune.teacher_weight: the detection teacher reads {list(self.teacher_pp.hw)} "
                                 f"and the student {list(student_pp.hw)}; their locations line up only at one size: "
                                 f"set teacher.image_size and student.image_size alike, or finetune.teacher_weight 0")
        self.flatten, self.num_classes = flatten, num_classes
        for p in teacher.parameters():
            p.requires_grad_(False)
        teacher.eval().to(distributed.device())
        if task == "detection":
            self.forward = (FlipAveraged(teacher) if flip else teacher).forward_dense
        else:  # a segmentation teacher's logits at its own stride, resized inside the loss as its forward would
            fn = getattr(teacher, "forward_logits", teacher)
            self.forward = flip_averaged(fn) if flip else fn

    @classmethod
    def from_stage(cls, teacher_stage, recipe, task: str, student_pp: Preprocess, flatten=None,
                   num_classes: int = 0) -> "TeacherLoss":
        """The teacher of ``teacher.finetune``'s output, with the recipe's weight, temperature and flip."""
        teacher = load_model(teacher_stage.path("model"))
        return cls(teacher, task, student_pp, recipe.finetune.teacher_weight, recipe.distill.temperature,
                   recipe.distill.teacher_flip, flatten, num_classes)

    def __call__(self, x: torch.Tensor, out: Output) -> torch.Tensor:
        with torch.no_grad():
            t = self.forward(teacher_view(x, self.student_pp, self.teacher_pp)).float()
        if self.task == "detection":
            loss = dense_detection_loss(self.flatten(out), dense_targets(t, self.num_classes), self.num_classes)
            return self.weight * loss["total"]
        return self.weight * task_oriented_loss(out, t, self.temperature)
