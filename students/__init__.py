"""Students: small on-device models, distillation from the teacher, finetuning and the label-only baseline; and,
side by side, the two labeling commands that read a finished build: label-next (which pool images to label) and
pseudo-label (the teacher's labels on the pool, for review)."""
from pathlib import Path

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.stage import register_recipe_check
from vfm_toolchain.students import (models, losses, detection, detection_distill, distill, finetune,  # noqa: F401
                                    fold, qat, label_next)  # (register)
from vfm_toolchain.students.models import STUDENTS
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.tasks import task_of

__all__ = ["STUDENTS"]


@register_recipe_check
def _check_names(recipe) -> None:
    if recipe.student.name == "auto":  # chosen by student.select (bench/select.py), which checks its candidates
        return
    STUDENTS.check(recipe.student.name)
    models.check_timm_name(recipe.student.name)
    w = recipe.student.weights
    if w not in ("none", "pretrained") and Path(w).is_file():  # cheap to build: a checkpoint of another model or
        # size fails now, not after the teacher
        models.create_student(recipe.student.name, 2, w, recipe.data.task, **recipe.student.form())


@register_recipe_check
def _check_task_student(recipe) -> None:
    """What the task's student cannot take, said now, not after the teacher and distillation ran: Gramian heads and
    a linear-probe head start are classifiers; then the task's own rules on its student (students/tasks/)."""
    task = task_of(recipe)
    if recipe.student.gramian.heads and "gramian_heads" not in task.supports:
        raise ToolchainError(f"student.gramian heads are classifiers on pooled features; a {task.name} student has "
                             f"none to put them on: set student.gramian.heads: 0 for data.task {task.name}")
    if recipe.finetune.head_start == "probe" and "linear_probe" not in task.supports:
        raise ToolchainError(f"finetune.head_start 'probe' fits a linear classifier, which a {task.name} student's "
                             f"head is not; for data.task {task.name} use 'keep' or 'auto'")
    student_task(task.name).check(recipe)
