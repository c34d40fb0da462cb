"""What a person watching a build sees: log lines, progress with ETA, and ``build.log``.

One console (stderr) serves both the log handler and the progress display, so log lines print above a live
bar instead of tearing it.  On a terminal, long loops get a rich progress bar (count, rate, elapsed, ETA and
fields such as the loss); elsewhere (CI, ``| tee``, a file) a bar would be a stream of redraws, so the same
loops print a plain line every ``VFM_PROGRESS_SECONDS`` seconds (default 15) and one when they finish.

``setup_logging`` is called once by the CLI; ``build_log`` adds ``<out>/build.log`` (everything at DEBUG,
tracebacks included) for the length of a build, whoever called it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, TypeVar

from rich.console import Console

__all__ = ["CONSOLE", "setup_logging", "build_log", "track", "Track", "live_display"]

T = TypeVar("T")
CONSOLE = Console(stderr=True)
if not CONSOLE.is_terminal and "COLUMNS" not in os.environ:
    CONSOLE.width = 160  # a log file or CI page is not 80 columns wide: keep table rows and paths whole
# libraries that log a lot at DEBUG/INFO about their own internals; their warnings still come through
_NOISY = ("PIL", "matplotlib", "coremltools", "onnxslim", "urllib3", "filelock", "h5py", "numexpr", "faiss", "torch._dynamo",
          "torch.onnx", "onnxscript", "asyncio", "faster_coco_eval")  # the COCO evaluator logs every evaluate() call
_FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (test runners and notebooks swap it), not the one at setup."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _ours_or_error(record: logging.LogRecord) -> bool:
    """On the console without -v: the toolchain's own records, and anyone's errors."""
    return record.levelno >= logging.ERROR or not (record.name == "py.warnings" or record.name.startswith(_NOISY))


def live_display() -> bool:
    """True when progress may redraw in place: stderr is a terminal and nobody asked for plain lines."""
    return CONSOLE.is_terminal and not os.environ.get("VFM_PLAIN_PROGRESS")


def setup_logging(verbose: bool = False) -> None:
    """Console logging: INFO (DEBUG with ``-v``) for everything the toolchain says, rich on a terminal,
    timestamped plain lines elsewhere.  The root logger itself passes DEBUG so ``build.log`` gets it all."""
    if live_display():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=CONSOLE, show_path=False, markup=False,
                                               rich_tracebacks=False, log_time_format="%H:%M:%S")
    else:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler.set_name("vfm-console")
    if not verbose:  # libraries' own warnings (tracer, deprecation, import-time chatter) are detail: build.log
        handler.addFilter(_ours_or_error)  # has them, -v shows them
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == "vfm-console":
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.captureWarnings(True)  # library warnings go through the handlers (and into build.log)


@contextlib.contextmanager
def build_log(path: Path) -> Iterator[Optional[Path]]:
    """Append every log record (DEBUG and up, with tracebacks) to ``path`` while the block runs.

    Appends, so a resumed build's log follows the killed one's; each build starts with a header line.  When
    the folder cannot be written the build goes on without a file (the caller has checked it beforehand)."""
    path = Path(path)
    root = logging.getLogger()
    try:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    except OSError:
        yield None
        return
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    old_level = root.level
    raised: list = []  # other handlers whose level we set for the block, to put back afterwards
    root.addHandler(handler)
    if root.level > logging.DEBUG or root.level == logging.NOTSET:
        root.setLevel(logging.DEBUG)
        if not any(h.get_name() == "vfm-console" for h in root.handlers):
            # called as a library (tests, notebooks): their handlers keep seeing what they saw before
            for h in root.handlers:
                if h is not handler and h.level == logging.NOTSET:
                    raised.append(h)
                    h.setLevel(old_level or logging.WARNING)
        for name in _NOISY:
            logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("toolchain").debug("---- build log opened by pid %d: %s", os.getpid(), " ".join(sys.argv))
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(old_level)
        for h in raised:
            h.setLevel(logging.NOTSET)


# ---------------------------------------------------------------------------------------------------
# progress


_live = None          # the one rich Progress while any Track is open on a terminal
_open_tracks = 0


def _rich_progress():
    global _live
    if _live is None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        _live = Progress(TextColumn("{task.description}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                         TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                         TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=CONSOLE, transient=True)
        _live.start()
    return _live


def _fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Track:
    """Progress of one long loop over ``total`` units (batches, images, shards, iterations).

    ``advance(n)`` counts done units; ``set(loss=0.41)`` shows fields beside the bar; ``describe`` renames
    it (the epoch changes).  Iterate a ``track(...)`` to advance by one per item.  On a non-terminal it logs
    ``description: done/total unit (rate), elapsed, ETA, fields`` every ``interval`` seconds, and a closing
    line when it was long enough to have logged before."""

    def __init__(self, description: str, total: Optional[int], unit: str = "it",
                 log: Optional[logging.Logger] = None, interval: Optional[float] = None):
        global _open_tracks
        self.description, self.total, self.unit = description, total, unit
        self.log = log or logging.getLogger("toolchain.progress")
        self.interval = float(os.environ.get("VFM_PROGRESS_SECONDS", 15)) if interval is None else interval
        self.done, self.fields = 0, {}
        self.t0 = self._last = time.monotonic()
        self._logged = False
        self._task = None
        if live_display():
            _open_tracks += 1
            self._task = _rich_progress().add_task(description, total=total, rate="", info="")

    def _rate(self) -> float:
        return self.done / max(1e-9, time.monotonic() - self.t0)

    def _info(self) -> str:
        return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.fields.items())

    def _line(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self._rate()
        of = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and rate > 0 and self.done < self.total:
            eta = f", ETA {_fmt_seconds((self.total - self.done) / rate)}"
        info = self._info()
        return (f"{self.description}: {self.done}{of} {self.unit} ({rate:.3g} {self.unit}/s), "
                f"{_fmt_seconds(elapsed)} elapsed{eta}{'  ' + info if info else ''}")

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._task is not None:
            _rich_progress().update(self._task, advance=n, rate=f"{self._rate():.3g} {self.unit}/s", info=self._info())
        elif time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            self._logged = True
            self.log.info(self._line())

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)

    def describe(self, description: str) -> None:
        self.description = description
        if self._task is not None:
            _rich_progress().update(self._task, description=description)

    def close(self) -> None:
        global _live, _open_tracks
        if self._task is not None:
            _rich_progress().remove_task(self._task)
            self._task = None
            _open_tracks -= 1
            if _open_tracks == 0 and _live is not None:
                _live.stop()
                _live = None
        elif self._logged:
            self.log.info(self._line())
            self._logged = False

    def __enter__(self) -> "Track":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Iterating(Track):
    def __init__(self, iterable: Iterable[T], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._iterable = iterable

    def __iter__(self) -> Iterator[T]:
        try:
            for item in self._iterable:
                yield item
                self.advance(1)
        finally:
            self.close()


def track(iterable: Iterable[T], total: Optional[int], description: str, unit: str = "it",
          log: Optional[logging.Logger] = None) -> "_Iterating":
    """Iterate ``iterable`` with progress; the returned object also takes ``set(...)`` for live fields."""
    return _Iterating(iterable, description, total, unit=unit, log=log)

