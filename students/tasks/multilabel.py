"""The multi-label student: the registered model with its own classifier, one logit per tag
(students/models.py), distilled on the finetuned teacher's per-tag probabilities.

Task-oriented transfer (seed 004 sec. 2, Fig. 1b) matches the teacher's softened predictions; with one sigmoid per
tag the prediction is a Bernoulli per tag, so the loss is each tag's binary cross-entropy against the teacher's
probability at temperature T (times T^2, as the softmax KD keeps the gradient's scale), averaged over the tags.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vfm_toolchain.students.objectives import OBJECTIVES
from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@OBJECTIVES.register("tag_distillation", teacher="finetuned", task="multilabel",
                     source="seed 004 sec. 2, Fig. 1b, one Bernoulli per tag")
class TagDistillation(nn.Module):
    """The student's per-tag sigmoid against the teacher's at temperature T."""

    def __init__(self, student: nn.Module, temperature: float = 4.0, **_):
        super().__init__()
        self.student, self.temperature = student, temperature

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.half()  # the teacher's logits

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        t = self.temperature
        soft = torch.sigmoid(target.float() / t)
        return F.binary_cross_entropy_with_logits(self.student(x).float() / t, soft) * t * t


def _binary_entropy(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-6, 1 - 1e-6)
    return -(p * p.log2() + (1 - p) * (1 - p).log2())


@STUDENT_TASKS.register("multilabel")
class MultiLabelStudent(StudentTask):
    name = "multilabel"
    task_objective = "tag_distillation"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.models import create_classifier

        return create_classifier(name, num_classes, weights)

    def distill_how(self, d: Any, result: Dict[str, Any]) -> str:
        if d.mode == "task_oriented":
            return (f"task-oriented distillation from the finetuned teacher (per-tag binary cross-entropy against "
                    f"its probabilities, T={d.temperature})")
        return super().distill_how(d, result)

    def report(self, section: Any, key: str, title: str, result: Dict[str, Any], sheet: str) -> None:
        from vfm_toolchain.tasks.multilabel import add_tag_report

        add_tag_report(section, key, f"{title} (multi-label)", result)

    def label_next_parts(self, teacher: Any, student: Any, uncertainty: str,
                         box_threshold: float) -> Tuple[Any, Any, Any]:
        """Uncertainty: the largest binary entropy of a tag's probability (one tag near 0.5 is worth a label;
        ``--uncertainty`` has one measure here); disagreement: the largest Jensen-Shannon divergence (base 2) of a
        tag's Bernoulli, teacher against student; the predicted class: the teacher's likeliest tag."""
        pt, ps = teacher.clamp(1e-6, 1 - 1e-6), student.clamp(1e-6, 1 - 1e-6)
        m = (pt + ps) / 2
        js = _binary_entropy(m) - (_binary_entropy(pt) + _binary_entropy(ps)) / 2
        return (_binary_entropy(pt).max(1).values.numpy(), js.clamp(0, 1).max(1).values.numpy(),
                pt.argmax(1).numpy())

    def classes_seen(self, teacher: Any, num_classes: int, box_threshold: float, min_share: float) -> Any:
        """Every tag at 0.5 or more."""
        return (teacher >= 0.5).numpy()
