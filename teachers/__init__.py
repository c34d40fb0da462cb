"""Teachers: foundation-model backbones, adapters, the finetune stage and transfer-set curation."""
# Every module that registers something is imported here, so a model family ("segmentation_teacher")
# is known even when the stage that builds it is cached and never ran in this process.
import math

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.sizes import nearest_sizes
from vfm_toolchain.core.sizes import image_hw
from vfm_toolchain.stage import register_recipe_check
from vfm_toolchain.tasks import task_of
from vfm_toolchain.tasks.detection import DETECTION_STRIDE
from vfm_toolchain.teachers import backbones, adapters, model, segmentation, detection, finetune, curate  # noqa: F401  (register)
from vfm_toolchain.teachers.adapters import ADAPTERS
from vfm_toolchain.teachers.backbones import BACKBONES
from vfm_toolchain.teachers.backbones.base import has_text_tower, resolve_weights
from vfm_toolchain.teachers.strategies import STRATEGIES
from vfm_toolchain.teachers.tasks import teacher_task

__all__ = ["BACKBONES", "ADAPTERS", "STRATEGIES", "check_detection_size", "detection_multiple"]


@register_recipe_check
def _check_names(recipe) -> None:
    """The teacher model (name, pretrained tag, input size), its adapter and the curation strategy: each is
    first used at stage 3 or 4, after data.prepare, so each is checked before the first stage."""
    t = recipe.teacher
    teacher_task(recipe.data.task).check(recipe)  # the backbone at the input size the task's teacher needs
    if t.weights.startswith("package:"):  # a packaged file that is not there (local files: toolchain/preflight.py)
        resolve_weights(t.weights)
    if t.head_init == "zero_shot" and "zero_shot_head" not in task_of(recipe).supports:
        raise ToolchainError(f"teacher.head_init zero_shot starts a classifier from class-name embeddings; a "
                             f"{recipe.data.task} teacher's head has no such start: use teacher.head_init: random for "
                             f"data.task {recipe.data.task}")
    if t.head_init == "zero_shot" and not has_text_tower(t.name):
        raise ToolchainError(f"teacher.head_init zero_shot starts the head from the text tower's class-name "
                             f"embeddings, and {t.name} has no text tower (only open_clip models have one); use "
                             f"teacher.head_init: random, or an open_clip teacher")
    ADAPTERS.check(t.adapter.name)
    adapters.adapter_options(t.adapter)
    STRATEGIES.check(recipe.curate.strategy)


# after the names above: a misspelt strategy is reported as such before what curation needs of it
register_recipe_check(curate.check_curate)


def _detection_geometry(name: str, weights: str):
    """The backbone's input geometry (None where its library does not say) and what each side of a detection input
    is a multiple of: 32 and, for a ViT, its patch."""
    geometry = BACKBONES.meta(name).get("geometry")
    geo = geometry(name.split(":", 1)[1], weights) if geometry is not None else None
    patch = max(geo.patch) if geo is not None and geo.patch else 1
    return geo, math.lcm(DETECTION_STRIDE, patch)


def detection_multiple(name: str, weights: str) -> int:
    """Every side of a detection teacher's input (and so its student's) is a multiple of this."""
    return _detection_geometry(name, weights)[1]


def check_detection_size(name: str, weights: str, image_size, field: str) -> None:
    """A detection teacher's input: every side a multiple of 32 (its maps at strides 8 / 16 / 32 tile the input
    exactly, blocks/detection.py) and of a ViT's patch (``check_backbone``'s rule), so a multiple of both.
    The size given is checked when the recipe loads; here also the model's own size when none is given, and the
    patch, which only the model knows.

    Raises:
        ToolchainError: naming the size and the nearest valid ones.
    """
    geo, multiple = _detection_geometry(name, weights)
    hw = image_hw(image_size) if image_size is not None else (geo.default if geo is not None else None)
    if hw is None:  # a plugin's library that does not say: the detector's own check says it when it is built
        return
    if all(side % multiple == 0 for side in hw):
        return
    spelled = str(hw[0]) if hw[0] == hw[1] else f"[{hw[0]}, {hw[1]}]"
    at = f"{field} {spelled}" if image_size is not None else \
        f"{name}'s own input size {spelled} ({field} is not set)"
    why = "the detector's strides 8, 16 and 32 must tile the input exactly"
    if multiple != DETECTION_STRIDE:
        why = (f"both of {DETECTION_STRIDE}, so that the detector's strides 8, 16 and 32 tile the input exactly, and "
               f"of {name}'s patch size {max(geo.patch)}")
    raise ToolchainError(f"{at} is not a multiple of {multiple} on each side, which detection needs ({why}); "
                         f"nearest valid: {field} {nearest_sizes(hw, multiple)}")
