"""The output folder a person opens (``--out``): each build writes a folder of its own, and the top of the
output folder shows one complete build, switched in a single rename.

Layout::

    <out>/builds/<id>/              one build: build.json, recipe.resolved.yaml, argv.json, stages/ (links into
                                    the store) and, once its report stage ran, report.md, plots and artifacts/
    <out>/current -> builds/<id>    the build the folder shows: the last complete one (until one completes, the
                                    newest attempt, so a first build that failed still shows its record)
    <out>/build.json -> current/build.json    every other top-level name a link through ``current``
    <out>/build.log                 everything every build into this folder said, appended (tracebacks too)
    <out>/.build.lock               two builds into one folder run one after the other

Why: a build that copied its artifacts over the previous ones could be killed, or run out of disk, half way
and leave a truncated model beside a report describing another build.  Here the new build's files are all in
place before ``current`` is switched by ``os.replace`` of one symbolic link, so ``build.json``, ``report.md`` and
``artifacts/`` always describe the same build, and a failed or killed build leaves the last good one as it was.
The links are relative, so the folder can be moved or copied (``cp -r`` keeps links) and still works.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

__all__ = ["OutputFolder"]

log = logging.getLogger("toolchain")

# What the toolchain itself puts at the top of an output folder, besides the build's own files.
_OWN = {"builds", "current", "build.log", ".build.lock"}
# Top-level names an output folder written before builds/ existed holds (moved into builds/ once, see _adopt)
_LEGACY = {"build.json", "report.md", "recipe.resolved.yaml", "argv.json", "artifacts", "stages"}
# Builds kept besides the one shown: the ones just before it (for a look back), newest first
KEEP_PREVIOUS = 2


class OutputFolder:
    """One ``--out`` folder.  The caller holds its ``.build.lock`` around everything here."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.builds = self.root / "builds"
        self.current = self.root / "current"

    # ---- one build

    def begin(self) -> Path:
        """A new, empty folder for this build under ``builds/``."""
        self._adopt()
        self.builds.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1000):  # two builds in one second (a study's rows) get their own folders
            attempt = self.builds / (f"{stamp}-{n:03d}")
            try:
                attempt.mkdir()
                return attempt
            except FileExistsError:
                continue
        raise RuntimeError(f"cannot create a build folder in {self.builds}")

    def settle(self, attempt: Path, complete: bool) -> bool:
        """Show ``attempt`` when it completed, or when no complete build is shown yet; returns whether the top
        of the folder now shows it.  Old builds beyond ``KEEP_PREVIOUS`` are deleted after a switch."""
        if not complete and self.shown_complete():
            return False
        tmp = self.root / f".current.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.path.relpath(attempt, self.root), target_is_directory=True)
        os.replace(tmp, self.current)  # the switch: one rename
        self._link_top_level()
        self._prune()
        return True

    def shown_complete(self) -> bool:
        """True when the folder already shows a complete build."""
        return _status(self.current) == "complete"

    def shown(self) -> Optional[Path]:
        return self.current.resolve() if self.current.is_dir() else None

    # ---- the top level

    def _link_top_level(self) -> None:
        """Every name in the shown build appears at the top as a link through ``current``; a link whose name
        the shown build does not have (a plot an older build made) is removed."""
        shown = self.current
        names = {p.name for p in shown.iterdir()}
        for name in sorted(names - _OWN):
            link = self.root / name
            if link.is_symlink() and os.readlink(link) == f"current/{name}":
                continue
            if link.exists() and not link.is_symlink():
                continue  # a file of the user's that happens to share the name is never replaced
            tmp = self.root / f".{name}.{os.getpid()}.link"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(f"current/{name}")
            os.replace(tmp, link)
        for link in self.root.iterdir():
            if link.is_symlink() and os.readlink(link).startswith("current/") and link.name not in names:
                link.unlink()

    def _adopt(self) -> None:
        """An output folder written by a toolchain before ``builds/`` held its build at the top: move those files
        into a build folder of their own (nothing is deleted) and show it, so the next switch is atomic too."""
        found = [self.root / n for n in sorted(_LEGACY) if (self.root / n).exists() and not (self.root / n).is_symlink()]
        if not found or self.current.is_symlink():
            return
        legacy = self.builds / f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(found[0].stat().st_mtime))}-legacy"
        legacy.mkdir(parents=True, exist_ok=True)
        found += [p for p in sorted(self.root.glob("*.png")) if not p.is_symlink()  # the report's plots
                  if p.name == "accuracy_vs_latency.png" or p.name.startswith("transfer_")]
        for p in found:
            os.replace(p, legacy / p.name)
        log.info("output folder %s: the earlier build's files moved to %s (builds are kept in builds/ now)",
                 self.root, legacy)
        self.settle(legacy, complete=True)

    def _prune(self) -> None:
        shown = self.shown()
        others = sorted((p for p in self.builds.iterdir() if p.is_dir() and p.resolve() != shown),
                        key=lambda p: p.name, reverse=True)
        for old in others[KEEP_PREVIOUS:]:
            shutil.rmtree(old, ignore_errors=True)


def _read(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _status(build: Path) -> Optional[str]:
    """A build folder's status as its record says (``complete`` only when every stage finished)."""
    record = _read(build / "build.json")
    if record is None:
        return None
    return record.get("status", "complete" if record.get("artifacts") is not None else None)
