"""Students: small on-device models, distillation from the teacher, finetuning and the label-only baseline."""
from students import models, losses, distill, finetune  # noqa: F401  (register)
from students.models import STUDENTS
from toolchain.stage import register_recipe_check

__all__ = ["STUDENTS"]


@register_recipe_check
def _check_names(recipe) -> None:
    STUDENTS.check(recipe.student.name)
    models.check_timm_name(recipe.student.name)
