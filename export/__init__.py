"""Export: fold passes, one file per format, the parity gate and the ``export.convert`` stage."""
from export import fold, formats, convert  # noqa: F401  (register)
from export.fold import FOLDS
from export.formats import FORMATS
from toolchain.stage import register_recipe_check

__all__ = ["FORMATS", "FOLDS"]


@register_recipe_check
def _check_names(recipe) -> None:
    for fmt in recipe.export.formats:
        FORMATS.check(fmt)
