"""Teachers: foundation-model backbones, adapters, the finetune stage and transfer-set curation."""
# Every module that registers something is imported here, so a model family ("segmentation_teacher")
# is known even when the stage that builds it is cached and never ran in this process.
from teachers import backbones, adapters, model, segmentation, finetune, curate  # noqa: F401  (register)
from teachers.adapters import ADAPTERS
from teachers.backbones import BACKBONES
from teachers.strategies import STRATEGIES
from toolchain.stage import register_recipe_check

__all__ = ["BACKBONES", "ADAPTERS", "STRATEGIES"]


@register_recipe_check
def _check_names(recipe) -> None:
    BACKBONES.check(recipe.teacher.name)
    ADAPTERS.check(recipe.teacher.adapter.name)
    adapters.adapter_options(recipe.teacher.adapter)
    STRATEGIES.check(recipe.curate.strategy)
