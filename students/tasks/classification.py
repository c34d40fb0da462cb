"""The classification student: the registered model with its own classifier (students/models.py)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("classification")
class ClassificationStudent(StudentTask):
    name = "classification"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.models import create_classifier

        return create_classifier(name, num_classes, weights)

    def distill_metrics(self, ctx: Any, student: Any, index: Dict[str, Any], spp: Any,
                        t_cache: Any) -> Dict[str, Any]:
        """Also how often the teacher's class on a cached view is its class on the plain image (view 0): how much
        the views change what the teacher says."""
        import numpy as np

        result = super().distill_metrics(ctx, student, index, spp, t_cache)
        if ctx.recipe.distill.mode == "task_oriented" and t_cache is not None and t_cache.ndim == 3:
            result["teacher_view_agreement"] = float(
                (np.asarray(t_cache[:, 0]).argmax(-1) == np.asarray(t_cache[:, -1]).argmax(-1)).mean())
        return result

    def label_next_parts(self, teacher: Any, student: Any, uncertainty: str,
                         box_threshold: float) -> Tuple[Any, Any, Any]:
        """1 - margin (or normalised entropy) of the teacher's probabilities, their Jensen-Shannon divergence from
        the student's, and the teacher's class."""
        from vfm_toolchain.students.label_next import classification_parts

        return classification_parts(teacher, student, uncertainty)

    def classes_seen(self, teacher: Any, num_classes: int, box_threshold: float, min_share: float) -> Any:
        """The predicted class."""
        import torch

        return torch.nn.functional.one_hot(teacher.argmax(1), num_classes).bool().numpy()
