"""The contract of a task's teacher part (see the package docstring)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

from vfm_toolchain.core.registry import Registry
from vfm_toolchain.tasks.base import task_part

__all__ = ["TEACHER_TASKS", "TeacherTask", "teacher_task"]

TEACHER_TASKS = Registry("teacher task")


class TeacherTask:
    """How a task's teacher is built, prepared, saved and described (teachers/finetune.py asks it)."""

    name: str = ""
    what: str = "teacher"  # the teacher as the log names it
    # an adapter's label-free phase (grappa) and its regulariser (LLU) run for this task's teacher
    adapter_phases: bool = True
    result: Dict[str, Any] = {}  # entries the stage's result always carries for this task
    # curation queries the labeled objects (crops of its boxes, teachers/object_queries.py) besides whole images
    object_queries: bool = False

    def check(self, recipe: Any) -> None:
        """The teacher's backbone and input size, from the model's shape without weights (before the first
        stage): ``check_backbone``'s rules."""
        from vfm_toolchain.teachers.backbones.base import check_backbone

        t = recipe.teacher
        check_backbone(t.name, t.weights, t.image_size, "teacher.image_size")

    def create(self, teacher: Any, classes: Sequence[str]) -> Any:
        """The teacher model (``teacher``: the recipe's teacher section) with its adapter and a new head."""
        raise NotImplementedError

    def spec(self, teacher: Any, classes: Sequence[str], preprocess: Any, model: Any) -> Dict[str, Any]:
        """What is saved beside the weights so export and bench rebuild the model (toolchain/checkpoint.py)."""
        raise NotImplementedError

    def before_training(self, ctx: Any, model: Any, index: Dict[str, Any], preprocess: Any) -> Dict[str, Any]:
        """Steps between building and training the teacher; returns entries for the stage's result."""
        return {}

    def report(self, section: Any, result: Dict[str, Any]) -> None:
        """What the task adds to teacher.finetune's report section besides the accuracy row."""


def teacher_task(name: str) -> TeacherTask:
    """The teacher part of task ``name`` (toolchain/tasks/base.py ``task_part``)."""
    return task_part(TEACHER_TASKS, name, "teacher", "teachers/tasks/")
