"""The segmentation teacher: the backbone at output stride 8 (or 16) with a DeepLabV3 head (seed 004 A.1,
teachers/segmentation.py)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

from vfm_toolchain.teachers.tasks.base import TEACHER_TASKS, TeacherTask


@TEACHER_TASKS.register("segmentation")
class SegmentationTeacher(TeacherTask):
    name = "segmentation"
    what = "segmentation teacher"
    adapter_phases = False
    result = {"task": "segmentation"}

    def check(self, recipe: Any) -> None:
        """The backbone at its output stride (a ViT's patch stride, or a ConvNet's dilation)."""
        from vfm_toolchain.teachers.backbones.base import check_backbone

        t = recipe.teacher
        check_backbone(t.name, t.weights, t.image_size, "teacher.image_size", t.output_stride)

    def create(self, teacher: Any, classes: Sequence[str]) -> Any:
        from vfm_toolchain.teachers.segmentation import create_segmentation_teacher

        return create_segmentation_teacher(teacher.name, teacher.weights, teacher.image_size, len(classes),
                                           teacher.adapter, teacher.output_stride)

    def spec(self, teacher: Any, classes: Sequence[str], preprocess: Any, model: Any) -> Dict[str, Any]:
        from vfm_toolchain.teachers.segmentation import segmentation_teacher_spec

        return segmentation_teacher_spec(teacher.name, teacher.image_size, classes, teacher.adapter, preprocess,
                                         teacher.output_stride)
