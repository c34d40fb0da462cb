"""Export: fold passes, one file per format, the parity gate and the ``export.convert`` stage."""
from export import fold, formats, convert  # noqa: F401  (register)
from export.fold import FOLDS
from export.formats import FORMATS
from toolchain.errors import ToolchainError
from toolchain.stage import register_recipe_check

__all__ = ["FORMATS", "FOLDS"]


# the package whose runtime a format's parity gate needs, and how to get it: onnxruntime is not a base
# dependency because the CPU and GPU builds (onnxruntime / onnxruntime-gpu) install the same module and cannot
# sit side by side, so each install names one through an extra
_INSTALL = {"onnxruntime": "pip install 'vfm-toolchain[cpu]' (or 'vfm-toolchain[gpu]' on a CUDA 13 machine)"}


@register_recipe_check
def _check_names(recipe) -> None:
    import importlib.util

    for fmt in recipe.export.formats:
        FORMATS.check(fmt)
        module = FORMATS.meta(fmt).get("checked_by")
        if module and importlib.util.find_spec(module) is None:
            raise ToolchainError(f"export.formats has '{fmt}', whose parity gate runs in {module}, which is not "
                                 f"installed: {_INSTALL.get(module, f'pip install {module}')}")
