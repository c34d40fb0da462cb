"""Bench: latency measurement of the exported artifacts (through the runtime layer, export/runtimes), the choice of a
student by a latency budget, device bundles, and the build report."""
from vfm_toolchain.bench import latency, select, report  # noqa: F401  (register)
from vfm_toolchain.export.runtimes import RUNTIMES
from vfm_toolchain.stage import register_recipe_check

__all__ = ["RUNTIMES"]


@register_recipe_check
def _check_names(recipe) -> None:
    for rt in recipe.bench.runtimes:
        if rt != "auto":  # auto: pytorch + the runtime each exported format declares (bench/latency.py)
            RUNTIMES.check(rt)


@register_recipe_check
def _check_candidates(recipe) -> None:
    if recipe.student.name == "auto":  # student.select exports and times these: checked before any stage
        select.candidate_names(recipe)
        select.check_target(recipe)
