"""Students: small on-device models, distillation from the teacher, finetuning and the label-only baseline."""
from pathlib import Path

from vfm_toolchain.students import models, losses, detection, distill, finetune  # noqa: F401  (register)
from vfm_toolchain.students.models import STUDENTS
from vfm_toolchain.stage import register_recipe_check

__all__ = ["STUDENTS"]


@register_recipe_check
def _check_names(recipe) -> None:
    if recipe.student.name == "auto":  # chosen by student.select (bench/select.py), which checks its candidates
        return
    STUDENTS.check(recipe.student.name)
    models.check_timm_name(recipe.student.name)
    w = recipe.student.weights
    if w not in ("none", "pretrained") and Path(w).is_file():  # cheap to build: a checkpoint of another model or
        models.create_student(recipe.student.name, 2, w, recipe.data.task)  # size fails now, not after the teacher
