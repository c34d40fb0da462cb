"""The detection student: the registered model's backbone under an FPN neck and an FCOS head at strides 8 / 16 / 32
(students/detection.py)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("detection")
class DetectionStudent(StudentTask):
    name = "detection"

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.detection import build_student_detector

        return build_student_detector(name, num_classes, weights)

    def spec(self, name: str, classes: Sequence[str], preprocess: Any,
             gramian: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        from vfm_toolchain.students.detection import detection_student_spec

        return detection_student_spec(name, classes, preprocess)

    def head_only(self, model: Any) -> Any:
        """The neck and head train; the backbone stays as distillation left it."""
        from vfm_toolchain.students.finetune import DetectorHeadOnly

        return DetectorHeadOnly(model)
