"""Export: fold passes, one file per format, the parity gate and the ``export.convert`` stage."""
from vfm_toolchain.export import fold, formats, convert  # noqa: F401  (register)
from vfm_toolchain.export.fold import FOLDS
from vfm_toolchain.export.formats import FORMATS
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.stage import register_recipe_check

__all__ = ["FORMATS", "FOLDS"]


@register_recipe_check
def _check_formats(recipe) -> None:
    """Names, per-format options against each format's schema, order, and the modules each format requires.
    (Formats missing something outside the user's reach, TensorRT without a GPU, Core ML prediction off macOS,
    are skipped at build time with the reason instead.)"""
    from vfm_toolchain.export.formats.base import format_options, missing_modules

    e = recipe.export
    for name, raw in e.options.items():  # names and values first; unused options: check_options_are_used
        FORMATS.check(name)  # an unknown format name: the valid names and a suggestion
        format_options(name, raw)
    for i, fmt in enumerate(e.formats):
        meta = FORMATS.meta(fmt)
        if meta["source"] == "onnx" and "onnx" not in e.formats[:i]:
            raise ToolchainError(f"export.formats: '{fmt}' is built from the fp32 ONNX artifact; list 'onnx' "
                                 f"before it")
        missing = missing_modules(fmt)
        if missing:
            raise ToolchainError(f"export.formats has '{fmt}', which needs {', '.join(missing)}, not installed "
                                 f"here: {meta['install']}")
