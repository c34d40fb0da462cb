"""The segmentation student: the registered model at output stride 8 with a DeepLabV3 head
(students/segmentation.py)."""
from __future__ import annotations

from typing import Any

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("segmentation")
class SegmentationStudent(StudentTask):
    name = "segmentation"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.segmentation import create_segmentation_student

        return create_segmentation_student(name, num_classes, weights)
