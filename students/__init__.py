"""Students: small on-device models, distillation from the teacher, finetuning and the label-only baseline."""
from pathlib import Path

from vfm_toolchain.students import models, losses, detection, distill, finetune, label_next  # noqa: F401  (register)
from vfm_toolchain.students.models import DEFAULT_CANDIDATES, STUDENTS
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.sizes import nearest_sizes
from vfm_toolchain.sizes import image_hw
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


@register_recipe_check
def _check_detection_student(recipe) -> None:
    """Detection: the student's input size fits its detector (every side a multiple of 32, of 64 for MobileViT-V2,
    whose last stage pads an odd grid and would move the stride-32 locations off the teacher's:
    ``student_detection_multiple``), for the named student or every candidate of ``name: auto``; no Gramian
    heads and no linear-probe head start, both classifiers (said now, not after the teacher and distillation
    ran).  The multiple of 32 itself is checked when the recipe loads."""
    if recipe.data.task != "detection":
        return
    s = recipe.student
    if s.gramian.heads:
        raise ToolchainError("student.gramian heads are classifiers on pooled features; a detector has none to "
                             "put them on: set student.gramian.heads: 0 for data.task detection")
    if recipe.finetune.head_start == "probe":
        raise ToolchainError("finetune.head_start 'probe' fits a linear classifier, which a detector's FCOS head "
                             "is not; for data.task detection use 'keep' or 'auto'")
    hw = image_hw(s.image_size)
    names = [s.name] if s.name != "auto" else (s.candidates or DEFAULT_CANDIDATES)
    need = {n: detection.student_detection_multiple(n) for n in names}
    misfit = sorted((n for n, m in need.items() if any(side % m for side in hw)), key=names.index)
    if not misfit:
        return
    multiple = max(need[n] for n in misfit)
    spelled = str(hw[0]) if hw[0] == hw[1] else f"[{hw[0]}, {hw[1]}]"
    fix = f"nearest valid: student.image_size {nearest_sizes(hw, multiple)}"
    if s.name != "auto":
        raise ToolchainError(f"student.image_size {spelled} is not a multiple of {multiple} on each side, which the "
                             f"detection form of {s.name} needs (MobileViT's last stage pads an odd grid, which would "
                             f"move its stride-32 locations off the teacher's); {fix}")
    raise ToolchainError(f"student.image_size {spelled} is not a multiple of {multiple} on each side, which the "
                         f"detection form of {len(misfit)} of the student.name: auto candidates needs "
                         f"({', '.join(misfit)}: MobileViT's last stage pads an odd grid); {fix}, or list "
                         f"student.candidates without them")
