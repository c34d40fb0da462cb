"""The segmentation student: the registered model at output stride 8 with a DeepLabV3 head
(students/segmentation.py)."""
from __future__ import annotations

from typing import Any, Tuple

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("segmentation")
class SegmentationStudent(StudentTask):
    name = "segmentation"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.segmentation import create_segmentation_student

        return create_segmentation_student(name, num_classes, weights)

    def label_next_parts(self, teacher: Any, student: Any, uncertainty: str,
                         box_threshold: float) -> Tuple[Any, Any, Any]:
        """Classification's parts per pixel, averaged over the image; the class the teacher gives most pixels."""
        from vfm_toolchain.students.label_next import segmentation_parts

        return segmentation_parts(teacher, student, uncertainty)

    def classes_seen(self, teacher: Any, num_classes: int, box_threshold: float, min_share: float) -> Any:
        """Every class on at least ``min_share`` of the pixels: a rare class (Stanford Background's water, a few
        percent of its pixels) is seldom any image's largest."""
        from vfm_toolchain.students.label_next import pixel_shares

        return (pixel_shares(teacher) >= min_share).numpy()
