"""Teachers: foundation-model backbones, adapters, the finetune stage and transfer-set curation."""
from teachers import backbones, adapters, model, finetune, curate  # noqa: F401  (register)
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
