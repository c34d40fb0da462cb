"""The areas that register stages, models, adapters, formats and runtimes.

``toolchain`` imports nothing else of ours statically; the areas are named here once and imported on
demand, so the orchestrator stays free of training and export code until a build needs it.

One import name: the distribution installs one package, ``vfm_toolchain``, which is the ``toolchain/`` folder, with
each area folder beneath it (``vfm_toolchain.teachers`` is ``teachers/``: setuptools' package-dir in pyproject.toml),
so nothing generic lands in site-packages.
"""
import importlib

__all__ = ["AREAS", "PACKAGE", "area_module", "load_plugins"]

PACKAGE = "vfm_toolchain"
AREAS = ("teachers", "students", "export", "bench")


def area_module(area: str) -> str:
    """The import name of a repository folder: ``toolchain`` is the package itself, an area sits beneath it."""
    return PACKAGE if area == "toolchain" else f"{PACKAGE}.{area}"


def load_plugins() -> None:
    importlib.import_module(f"{PACKAGE}.prepare")
    for area in AREAS:
        importlib.import_module(area_module(area))
