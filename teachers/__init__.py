"""Teachers: foundation-model backbones, adapters, the finetune stage and transfer-set curation."""
# Every module that registers something is imported here, so a model family ("segmentation_teacher")
# is known even when the stage that builds it is cached and never ran in this process.
from vfm_toolchain.teachers import backbones, adapters, model, segmentation, detection, finetune, curate  # noqa: F401  (register)
from vfm_toolchain.teachers.adapters import ADAPTERS
from vfm_toolchain.teachers.backbones import BACKBONES
from vfm_toolchain.teachers.backbones.base import check_backbone, has_text_tower, resolve_weights
from vfm_toolchain.teachers.strategies import STRATEGIES
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.stage import register_recipe_check

__all__ = ["BACKBONES", "ADAPTERS", "STRATEGIES"]


@register_recipe_check
def _check_names(recipe) -> None:
    """The teacher model (name, pretrained tag, input size), its adapter and the curation strategy: each is
    first used at stage 3 or 4, after data.prepare, so each is checked before the first stage."""
    t = recipe.teacher
    check_backbone(t.name, t.weights, t.image_size, "teacher.image_size",
                   t.output_stride if recipe.data.task == "segmentation" else None)
    if t.weights.startswith("package:"):  # a packaged file that is not there (local files: toolchain/preflight.py)
        resolve_weights(t.weights)
    if t.head_init == "zero_shot" and not has_text_tower(t.name):
        raise ToolchainError(f"teacher.head_init zero_shot starts the head from the text tower's class-name "
                             f"embeddings, and {t.name} has no text tower (only open_clip models have one); use "
                             f"teacher.head_init: random, or an open_clip teacher")
    ADAPTERS.check(t.adapter.name)
    adapters.adapter_options(t.adapter)
    STRATEGIES.check(recipe.curate.strategy)


# after the names above: a misspelt strategy is reported as such before what curation needs of it
register_recipe_check(curate.check_curate)
