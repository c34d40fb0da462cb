"""Checks that take seconds and save hours: every path and every data rule, before the first stage runs.

A missing ``student.weights`` found after the teacher trained for an hour, or a label budget larger than
the images present found as a silently smaller training set, is a lost afternoon.  Everything here reads
only folder listings and file headers; the registered-name checks live with each area (``teachers``,
``students``, ``export``, ``bench``).
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import Recipe
from vfm_toolchain.stage import register_recipe_check
from vfm_toolchain.tasks import task_of

__all__ = ["check_paths", "check_data", "check_training"]


def _local_weights(value: str) -> bool:
    return value not in ("pretrained", "none") and not value.startswith("package:")


@register_recipe_check
def check_paths(recipe: Recipe) -> None:
    """Every file and folder the recipe names exists, and the teacher's and a named curate encoder's checkpoints
    load safely (the student's is also fitted to its model, by the students' own check)."""
    problems: List[str] = []
    d = recipe.data
    if d.source == "folders":
        for key, value in (("data.train", d.train), ("data.val", d.val), ("data.test", d.test)):
            if value and not Path(value).is_dir():
                problems.append(f"{key} '{value}' is not a folder")
        for i, pool in enumerate(d.pools):
            if not any(ch in pool for ch in "*?[") and not Path(pool).exists():
                problems.append(f"data.pools[{i}] '{pool}' does not exist")
    # checkpoints the teacher stages load; the encoder's only when curate.encoder names a model of its own
    # (auto and teacher embed with teacher.weights, and teachers/curate.py refuses encoder_weights with them)
    teacher_side = [("teacher.weights", recipe.teacher.weights)]
    if recipe.curate.encoder not in ("auto", "teacher"):
        teacher_side.append(("curate.encoder_weights", recipe.curate.encoder_weights))
    for key, value in teacher_side + [("student.weights", recipe.student.weights)]:
        if _local_weights(value) and not Path(value).is_file():
            problems.append(f"{key} '{value}' is not a file (give a local .safetensors/.pth path, 'pretrained' "
                            f"or 'none')")
    if problems:
        raise ToolchainError("the recipe names paths that are not there:\n  " + "\n  ".join(problems))
    from vfm_toolchain.checkpoint import load_state_dict_safely

    for key, value in teacher_side:  # an unsafe or unreadable file is refused now, not at the stage
        if _local_weights(value):
            load_state_dict_safely(value)


@register_recipe_check
def check_data(recipe: Recipe) -> None:
    """What the task's data folders must hold, from listings and annotation files (images are decoded later, in
    data.prepare): the task's own check (toolchain/tasks/)."""
    if recipe.data.source == "folders":
        task_of(recipe).check_data(recipe)


@register_recipe_check
def check_training(recipe: Recipe) -> None:
    """Settings that validate one by one but make no sense together, or that this machine cannot honour."""
    from vfm_toolchain.devices import resolve

    resolve(recipe.device)  # 'cuda' on a machine without one: said now
    t = recipe.teacher
    if t.epochs == 0 and t.head_init != "zero_shot":
        raise ToolchainError("teacher.epochs is 0, which would leave the teacher's new classifier random; give at "
                             "least 1 epoch, or teacher.head_init: zero_shot (open_clip teachers) to use the text "
                             "embeddings as the classifier without training")
    if recipe.distill.epochs == 0:
        raise ToolchainError("distill.epochs is 0: the student would learn nothing from the teacher; give at least 1 "
                             "(or compare with the label-only student, which student.baseline trains anyway)")


# A precomputed pool's shards are read whole by the NaN check; up to this size that takes seconds, so it is done
# before the first stage; larger pools are checked by data.prepare, before it decodes an image.
EMBEDDING_CHECK_MAX_BYTES = 1 << 30


@register_recipe_check
def check_data_files(recipe: Recipe) -> None:
    """What the pools' files say, where reading them is cheap: what their lists and symlinks lead to, and the
    finite rows of precomputed pools (the splits are the task's check, :func:`check_data`).

    It also sets the build's image pixel limit (``data.max_image_pixels``): every process of a build passes
    here before its first stage, and every stage that decodes the images data.prepare accepted must accept them
    too (data/images.py).
    """
    from vfm_toolchain.data.images import set_max_image_pixels
    from vfm_toolchain.data.pools import check_embedding_rows, embedding_bytes, list_pool_source

    d = recipe.data
    set_max_image_pixels(d.max_image_pixels)
    if d.source != "folders":
        return
    for pool in d.pools:
        list_pool_source(pool, d.roots)  # what lists and symlinks lead to stays inside (core/roots.py)
        if 0 < embedding_bytes(pool) <= EMBEDDING_CHECK_MAX_BYTES:
            check_embedding_rows(pool)
