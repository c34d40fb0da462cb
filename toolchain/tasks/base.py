"""The task contract and its registry (see the package docstring)."""
from __future__ import annotations

from typing import Any, FrozenSet, Mapping, Optional, Sequence

from vfm_toolchain.registry import Registry

__all__ = ["TASKS", "Task", "register_task", "task_of", "LEGACY_TASK"]

TASKS = Registry("task")

# What a data index, a result or a spec written before they named their task holds: classification was the only
# task then.  The one place that default lives; anything that names a task names a registered one.
LEGACY_TASK = "classification"


class Task:
    """One task's answers.  A subclass sets the attributes and implements the methods; the stages ask it."""

    name: str = ""
    reads: str = ""  # what its data folders hold, as a message says it: "ImageFolder splits"
    metric: str = ""  # the main metric's key in a stage's metrics (``test_<metric>``): top1, miou, map50
    budget_unit: str = "labels per class"  # what data.labeled_per_class counts, as the study's table says it
    # recipe fields only this task reads ("data.format"): another task's recipe may not set them
    owns: FrozenSet[str] = frozenset()
    # what it can take that not every task can: strong_shift (a shift of the image alone: its labels do not move
    # with the geometry), label_mixing (mixup / cutmix of whole-image labels)
    supports: FrozenSet[str] = frozenset()

    def class_count(self, recipe: Any) -> int:
        """The recipe's number of classes, without running data.prepare (a model's head is sized by it)."""
        raise NotImplementedError

    def check_data(self, recipe: Any) -> None:
        """What the recipe's data folders must hold, from listings and annotation files alone (the recipe checks
        before the first stage; images are decoded in data.prepare).  Synthetic data is not checked here."""

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        """The main metric of ``model`` over a split's samples."""
        raise NotImplementedError


def register_task(cls: type) -> type:
    """Class decorator: register a task under its ``name``, declaring what ``toolchain list tasks`` shows."""
    TASKS.register(cls.name, reads=cls.reads, metric=cls.metric, label_budget=cls.budget_unit)(cls)
    return cls


def task_of(source: Any) -> Task:
    """The task of a recipe, a data index or stage result (a mapping with ``task``), or a task name.

    Raises:
        ToolchainError: a name no task registers, with the registered names.
    """
    if isinstance(source, str):
        name = source
    elif isinstance(source, Mapping):
        name = source.get("task", LEGACY_TASK)
    else:
        name = source.data.task
    return TASKS.get(name)()
