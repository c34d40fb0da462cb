"""Export: fold passes, one file per format, the parity gate and the ``export.convert`` stage."""
from export import fold, formats, convert  # noqa: F401  (register)
from export.fold import FOLDS
from export.formats import FORMATS
from toolchain.errors import ToolchainError
from toolchain.stage import register_recipe_check

__all__ = ["FORMATS", "FOLDS"]


# Runtimes a format's parity gate cannot do without, and how to install them.  ONNX Runtime is not a base
# dependency because its CPU and GPU builds (onnxruntime / onnxruntime-gpu) install the same module and cannot
# sit side by side, so each install names one through an extra.  (Formats whose runtime is missing for a
# reason outside the user's reach, TensorRT without a GPU, Core ML off macOS, are skipped with the reason.)
_REQUIRED_RUNTIMES = {"onnxruntime": ("onnxruntime", "pip install 'vfm-toolchain[cpu]' (or 'vfm-toolchain[gpu]' "
                                                     "on a CUDA 13 machine)")}


@register_recipe_check
def _check_formats(recipe) -> None:
    """Names, per-format options against each format's schema, order, and the runtimes parity needs."""
    import importlib.util

    from export.formats import format_options

    e = recipe.export
    for name, raw in e.options.items():  # checked even for a format not built now: a typo shows today
        FORMATS.check(name)  # an unknown format name: the valid names and a suggestion
        format_options(name, raw)
    for i, fmt in enumerate(e.formats):
        meta = FORMATS.meta(fmt)
        if meta["source"] == "onnx" and "onnx" not in e.formats[:i]:
            raise ToolchainError(f"export.formats: '{fmt}' is built from the fp32 ONNX artifact; list 'onnx' "
                                 f"before it")
        module, install = _REQUIRED_RUNTIMES.get(meta["runtime"], (None, None))
        if module and importlib.util.find_spec(module) is None:
            raise ToolchainError(f"export.formats has '{fmt}', whose parity gate runs in {module}, which is not "
                                 f"installed: {install}")
