"""Progress bars for long loops, shown only on a terminal (logs and CI get the per-epoch lines instead)."""
from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], total: Optional[int], description: str) -> Iterator[T]:
    if not sys.stderr.isatty():
        yield from iterable
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in iterable:
            yield item
            bar.advance(task)
