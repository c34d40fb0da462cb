"""The classification student: the registered model with its own classifier (students/models.py)."""
from __future__ import annotations

from typing import Any

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("classification")
class ClassificationStudent(StudentTask):
    name = "classification"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.models import create_classifier

        return create_classifier(name, num_classes, weights)
