"""The teachers' part of each task (toolchain/tasks/ holds the rest): the teacher model a task trains and saves, the
steps before its training, and what its report adds.  One file per task, found by scanning this folder, so a new
task adds a file here beside its file in toolchain/tasks/.
"""
from __future__ import annotations

import importlib
import pkgutil

from vfm_toolchain.teachers.tasks.base import TEACHER_TASKS, TeacherTask, teacher_task

__all__ = ["TEACHER_TASKS", "TeacherTask", "teacher_task"]

for _module in pkgutil.iter_modules(__path__):  # every task file registers itself
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
