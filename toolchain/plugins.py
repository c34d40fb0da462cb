"""The areas that register stages, models, adapters, formats and runtimes.

``toolchain`` imports nothing else of ours statically; the areas are named here once and imported on
demand, so the orchestrator stays free of training and export code until a build needs it.
"""
import importlib

__all__ = ["AREAS", "load_plugins"]

AREAS = ("teachers", "students", "export", "bench")


def load_plugins() -> None:
    importlib.import_module("toolchain.prepare")
    for area in AREAS:
        importlib.import_module(area)
