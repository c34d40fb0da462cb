"""Stages: typed units of the build with declared inputs, a config slice and a cached output folder.

A stage names its upstream stages (``inputs``), says which part of the recipe decides its output
(``config``), and ``run`` writes files into ``ctx.workdir`` and returns a JSON-able result.  The runner
hashes ``config`` + the inputs' keys + the environment into the stage key, so a stage never has to think
about caching; it only has to be deterministic given that key.  Long stages checkpoint inside
``ctx.workdir``, which survives a kill and is handed back on the next run.

A stage also describes its result for the build report (``report``): a :class:`ReportSection` with its own
section of ``report.md`` and its share of the parts several stages fill (what was built, the accuracy table,
warnings, the machine-readable parts of ``build.json``).  The ``report`` stage only assembles them, so a new
stage brings its wording with it and never edits the report.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry
from vfm_toolchain.recipe import Recipe

__all__ = ["Stage", "StageContext", "StageOutput", "STAGES", "register_stage", "PIPELINE", "RECIPE_CHECKS",
           "register_recipe_check", "ReportSection", "ReportContext", "Score", "Point", "percent", "metric_label"]

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
    "student.qat",
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


@dataclass
class Score:
    """A held-out test score a stage measured: a row of the report's accuracy table and an entry of build.json's
    ``metrics`` (``key``, e.g. ``teacher_top1``: build.json keys are what scripts read, so they never change)."""

    key: str
    label: str  # the table's row: "teacher (finetuned)"
    value: Optional[float]  # None: not measured (e.g. a head that distillation did not train)
    # The deployable model (an ``export.models`` name: student, teacher) this scores, so the accuracy-vs-latency
    # plot draws that model's timed artifacts at it; ``plot`` is its name there (None: not drawn).
    model: Optional[str] = None
    plot: Optional[str] = None
    # False: a model of the same architecture that was not exported (the labels-only baseline), drawn once at
    # the eager latency of ``model``
    exported: bool = True


@dataclass
class Point:
    """One point of the report's accuracy-vs-latency plot: an artifact timed at batch 1 and its test score."""

    label: str
    latency_ms: float
    score: float
    marker: str = "o"


@dataclass
class ReportSection:
    """What one stage adds to the build report.  Every part is optional; the report places each part where a
    reader looks for it and keeps the stages in pipeline order."""

    title: str = ""  # its own section of report.md ("## title"); "" when it has only the shared parts below
    lines: List[str] = field(default_factory=list)  # markdown under the title
    summary: List[str] = field(default_factory=list)  # bullets of "What was built"
    scores: List[Score] = field(default_factory=list)  # rows of the accuracy table, build.json "metrics"
    findings: List[str] = field(default_factory=list)  # sentences under the accuracy table
    points: List[Point] = field(default_factory=list)  # the accuracy-vs-latency plot
    warnings: List[str] = field(default_factory=list)  # besides the result's own "warnings"
    # files a person opens, copied beside report.md: published path -> path in the stage folder; ``lines``
    # link them by the published path
    files: Dict[str, str] = field(default_factory=dict)
    # machine-readable parts of build.json ("data", "artifacts", ...); dicts of two stages under one name merge
    record: Dict[str, Any] = field(default_factory=dict)
    # detection: the saved detectors the report draws on a few test images beside the ground truth (a column
    # label -> the model's folder in the stage folder), in pipeline order
    sheet: Dict[str, str] = field(default_factory=dict)


@dataclass
class ReportContext:
    """What a stage's ``report`` reads besides its own output: the recipe, every stage output of this build
    (``input`` as in :class:`StageContext`, so helpers written for a run work here too) and the sections of the
    stages before it (stages are asked in pipeline order)."""

    recipe: Recipe
    inputs: Dict[str, StageOutput]
    sections: Dict[str, ReportSection] = field(default_factory=dict)

    def input(self, name: str) -> StageOutput:
        out = self.inputs.get(name)
        if out is None:
            raise ToolchainError(f"the report needs the output of '{name}', which was skipped in this build")
        return out

    def scores(self, model: Optional[str] = None) -> List[Score]:
        """The scores reported so far, or those of one deployable model."""
        return [s for sec in self.sections.values() for s in sec.scores if model is None or s.model == model]


def percent(v: Optional[float]) -> str:
    """A score in [0, 1] as the report writes it: ``41.7%``, or ``n/a`` when it was not measured."""
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def metric_label(metric: str) -> str:
    """A metric name (``toolchain.training.metric_name``) as a reader knows it: a task's main metric as the task
    names it (toolchain/tasks/), detection's mAP@[.5:.95] beside its mAP50."""
    from vfm_toolchain.tasks import TASKS

    labels = {TASKS.get(t).metric: TASKS.get(t).metric_label for t in TASKS.list()}
    return {**labels, "map": "mAP@[.5:.95]"}.get(metric, metric)


class Stage:
    """Base class; subclasses set ``name``, ``inputs`` and implement ``config`` and ``run``, and ``report`` to
    describe their result in the build report."""

    name: str = ""
    inputs: Sequence[str] = ()
    optional_inputs: Sequence[str] = ()  # used when present, fine when skipped
    version: str = "1"  # bump when the stage's algorithm changes, so old cache entries are not reused
    # True: under torchrun every process runs the stage (each does its share; rank 0's result is kept).
    # False: rank 0 runs it while the other processes wait.
    distributed: bool = False
    # True: a cache hit hashes every file of the entry (what ships, e.g. exported artifacts), not only sizes
    verify_hashes: bool = False
    # bump when ``report`` writes something else: the report (keyed by every stage's report_version) is rebuilt,
    # this stage's own entry stays valid
    report_version: str = "1"
    # the data.task values the stage does its work for (None: every registered task, toolchain/tasks/); a build
    # whose task a stage it would run does not take is refused before the first stage (check_stages_take_the_task),
    # never failed half way
    tasks: Optional[Sequence[str]] = None

    def config(self, recipe: Recipe) -> Dict[str, Any]:
        raise NotImplementedError

    def read_inputs(self, recipe: Recipe) -> Sequence[str]:
        """The stages whose outputs this build's run reads, and whose keys are part of its key: ``inputs`` and the
        ``optional_inputs`` the recipe asks for (all of them, unless a stage says otherwise), so an option that
        reads one more stage leaves the keys of the builds that do not use it as they were."""
        return (*self.inputs, *self.optional_inputs)

    def skip_reason(self, recipe: Recipe) -> Optional[str]:
        """Return a reason to skip this stage in this build, or None to run it."""
        return None

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        raise NotImplementedError

    def report(self, out: StageOutput, build: ReportContext) -> Optional[ReportSection]:
        """This stage's part of the build report, from its output; None: nothing beyond its result's
        ``warnings`` (a list every stage may return, which the report always lists)."""
        return None


def register_stage(cls: type) -> type:
    STAGES.register(cls.name)(cls)
    return cls


@register_recipe_check
def check_stages_take_the_task(recipe: Recipe) -> None:
    """Every stage this build runs must do its work for ``data.task``: one that does not would fail after the
    stages before it ran (detection, say, on a stage not yet built for it)."""
    task = recipe.data.task
    refusing = [name for name in PIPELINE if name in STAGES and STAGES.get(name).tasks is not None
                and task not in STAGES.get(name).tasks and STAGES.get(name)().skip_reason(recipe) is None]
    if refusing:
        takes = sorted({", ".join(STAGES.get(n).tasks) for n in refusing})
        raise ToolchainError(f"data.task {task}: {', '.join(refusing)} cannot build it yet (they take "
                             f"{' / '.join(takes)}); switch those stages off where the recipe allows it, or use "
                             f"another task")
