"""The multi-label teacher: the classification teacher's backbone, adapter and linear head, one logit per tag (its
sigmoid and binary cross-entropy are the task's: toolchain/tasks/multilabel.py)."""
from __future__ import annotations

from typing import Any, Dict

from vfm_toolchain.teachers.tasks.base import TEACHER_TASKS
from vfm_toolchain.teachers.tasks.classification import ClassificationTeacher


@TEACHER_TASKS.register("multilabel")
class MultiLabelTeacher(ClassificationTeacher):
    name = "multilabel"
    what = "multi-label teacher"

    def report(self, section: Any, result: Dict[str, Any]) -> None:
        """Macro mAP and F1 on val and test, and each tag's threshold and test F1."""
        from vfm_toolchain.tasks.multilabel import add_tag_report

        add_tag_report(section, "teacher", "Teacher (multi-label)", result)
