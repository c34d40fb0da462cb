"""The detection teacher: the backbone with its adapter under an FPN neck and an FCOS head at strides 8 / 16 / 32
(teachers/detection.py)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

from vfm_toolchain.teachers.tasks.base import TEACHER_TASKS, TeacherTask


@TEACHER_TASKS.register("detection")
class DetectionTeacher(TeacherTask):
    name = "detection"
    what = "detection teacher"
    result = {"task": "detection"}
    object_queries = True

    def check(self, recipe: Any) -> None:
        """Every side a multiple of 32 and of a ViT's patch (teachers/__init__.py check_detection_size), said before
        the patch rule alone, whose nearest sizes may not be multiples of 32."""
        from vfm_toolchain.teachers import check_detection_size

        check_detection_size(recipe.teacher.name, recipe.teacher.weights, recipe.teacher.image_size,
                             "teacher.image_size")
        super().check(recipe)

    def create(self, teacher: Any, classes: Sequence[str]) -> Any:
        from vfm_toolchain.teachers.detection import create_detection_teacher

        return create_detection_teacher(teacher.name, teacher.weights, teacher.image_size, len(classes),
                                        teacher.adapter)

    def spec(self, teacher: Any, classes: Sequence[str], preprocess: Any, model: Any) -> Dict[str, Any]:
        from vfm_toolchain.teachers.detection import detection_teacher_spec

        return detection_teacher_spec(teacher.name, teacher.image_size, classes, teacher.adapter, preprocess)


    def report(self, section: Any, result: Dict[str, Any]) -> None:
        """mAP50 and mAP@[.5:.95] on val and test, the per-class APs, and the teacher's column of the sheet."""
        from vfm_toolchain.teachers.finetune import add_detection_report

        add_detection_report(section, "teacher", "Teacher (detection)", result, sheet="teacher")
