"""The contract of a task's student part (see the package docstring)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from vfm_toolchain.registry import Registry
from vfm_toolchain.tasks.base import task_part

__all__ = ["STUDENT_TASKS", "StudentTask", "student_task"]

STUDENT_TASKS = Registry("student task")


class StudentTask:
    """How a task's student is built and saved (students/models.py create_student, the distill and finetune
    stages)."""

    name: str = ""

    def check(self, recipe: Any) -> None:
        """The task's rules on its student that only the model knows (before the first stage)."""

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        """The registered student ``name`` in the task's form, from ``weights`` ('none', 'pretrained' or a local
        checkpoint of the classification model)."""
        raise NotImplementedError

    def spec(self, name: str, classes: Sequence[str], preprocess: Any,
             gramian: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """What is saved beside the weights (toolchain/checkpoint.py rebuilds the model from it): by default the
        ``student`` family's spec, which names the task (classification, segmentation)."""
        from vfm_toolchain.students.models import student_spec

        return student_spec(name, len(classes), preprocess, classes, gramian, self.name)

    def head_only(self, model: Any) -> Any:
        """``model`` with only its head trainable (``finetune.head_only``)."""
        from vfm_toolchain.students.finetune import HeadOnly

        return HeadOnly(model)


def student_task(name: str) -> StudentTask:
    """The student part of task ``name`` (toolchain/tasks/base.py ``task_part``)."""
    return task_part(STUDENT_TASKS, name, "student", "students/tasks/")
