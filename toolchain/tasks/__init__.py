"""Tasks: what differs between classification, segmentation and detection, one object per task (issue 65).

A stage asks the build's task instead of testing its name: ``task_of(recipe).metric``, ``.class_count(recipe)``,
``.check_data(recipe)``, ``.evaluate(...)``.  Each task is one file of this folder that registers itself in
:data:`TASKS`, and the folder is scanned on import, so a new task is a new file.  Higher floors will add their
own parts of a task (heads, targets, parity) through registries on their floors, as they register stages today.
"""
from __future__ import annotations

import importlib
import pkgutil

from vfm_toolchain.tasks.base import LEGACY_TASK, TASKS, Task, register_task, task_of

__all__ = ["TASKS", "Task", "register_task", "task_of", "LEGACY_TASK"]

for _module in pkgutil.iter_modules(__path__):  # every task file registers itself
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
