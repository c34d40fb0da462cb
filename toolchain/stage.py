"""Stages: typed units of the build with declared inputs, a config slice and a cached output folder.

A stage names its upstream stages (``inputs``), says which part of the recipe decides its output
(``config``), and ``run`` writes files into ``ctx.workdir`` and returns a JSON-able result.  The runner
hashes ``config`` + the inputs' keys + the environment into the stage key, so a stage never has to think
about caching; it only has to be deterministic given that key.  Long stages checkpoint inside
``ctx.workdir``, which survives a kill and is handed back on the next run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from toolchain.errors import ToolchainError
from toolchain.recipe import Recipe
from toolchain.registry import Registry

__all__ = ["Stage", "StageContext", "StageOutput", "STAGES", "register_stage", "PIPELINE", "RECIPE_CHECKS",
           "register_recipe_check"]

STAGES = Registry("stage")

# Checks run on the whole recipe before the first stage, so a misspelled student name fails in a second,
# not after an hour of teacher training.  Each area adds the checks for the names it owns.
RECIPE_CHECKS: List[Callable[[Recipe], None]] = []


def register_recipe_check(fn: Callable[[Recipe], None]) -> Callable[[Recipe], None]:
    RECIPE_CHECKS.append(fn)
    return fn

# The order of the build.  Each area registers its stages under these names.
PIPELINE: List[str] = [
    "data.prepare",
    "student.select",
    "teacher.finetune",
    "teacher.curate",
    "student.distill",
    "student.finetune",
    "student.baseline",
    "export.convert",
    "bench.latency",
    "report",
]


@dataclass
class StageOutput:
    """What a finished stage hands downstream: its folder and its result (``result.json``)."""

    name: str
    key: str
    dir: Path
    result: Dict[str, Any]

    def path(self, rel: str) -> Path:
        p = self.dir / rel
        if not p.exists():
            raise ToolchainError(f"stage '{self.name}' output '{rel}' is missing in {self.dir}; "
                                 f"delete that folder to rebuild the stage")
        return p


@dataclass
class StageContext:
    recipe: Recipe
    workdir: Path
    inputs: Dict[str, Optional[StageOutput]]
    log: logging.Logger
    history: List[Dict[str, Any]] = field(default_factory=list)  # stage records so far (for the report)
    rank: int = 0   # this process under torchrun (see toolchain.distributed); 0 of 1 otherwise
    world: int = 1
    # a store folder shared by every key of every stage, for caches that outlive one key (TensorRT timing
    # caches); None when the store is read-only
    shared: Optional[Path] = None

    def input(self, name: str) -> StageOutput:
        out = self.inputs.get(name)
        if out is None:
            raise ToolchainError(f"stage needs the output of '{name}', which was skipped in this build")
        return out


class Stage:
    """Base class; subclasses set ``name``, ``inputs`` and implement ``config`` and ``run``."""

    name: str = ""
    inputs: Sequence[str] = ()
    optional_inputs: Sequence[str] = ()  # used when present, fine when skipped
    version: str = "1"  # bump when the stage's algorithm changes, so old cache entries are not reused
    # True: under torchrun every process runs the stage (each does its share; rank 0's result is kept).
    # False: rank 0 runs it while the other processes wait.
    distributed: bool = False
    # True: a cache hit hashes every file of the entry (what ships, e.g. exported artifacts), not only sizes
    verify_hashes: bool = False

    def config(self, recipe: Recipe) -> Dict[str, Any]:
        raise NotImplementedError

    def skip_reason(self, recipe: Recipe) -> Optional[str]:
        """Return a reason to skip this stage in this build, or None to run it."""
        return None

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        raise NotImplementedError


def register_stage(cls: type) -> type:
    STAGES.register(cls.name)(cls)
    return cls
