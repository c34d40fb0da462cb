"""The students' part of each task (toolchain/tasks/ holds the rest): the student model a task trains, the spec it is
saved with, and the part of it a head-only finetune trains.  One file per task, found by scanning this folder.
"""
from __future__ import annotations

import importlib
import pkgutil

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask, student_task

__all__ = ["STUDENT_TASKS", "StudentTask", "student_task"]

for _module in pkgutil.iter_modules(__path__):  # every task file registers itself
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
