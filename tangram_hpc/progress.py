"""Progress of long command-line work (bench, fidelity, report), on stderr with ``rich.progress``.

Progress is shown only where someone watches it: when stderr is a terminal and
the command was not given ``--quiet``.  A pipe, a log file or a batch job's
output gets nothing (no spinner frames or carriage returns in logs), and the
results on stdout are the same either way.

Long work reports through a :class:`Progress`:

* calling it with a message (``progress("simulating fifo ...")``) says what
  runs now: one status line with a spinner and the time spent on it, the
  callback the simulator, the bench and the replay already take;
* :meth:`Progress.task` is a bar for work of known size (``advance(n)``);
* :meth:`Progress.reading` wraps a file being read, for a bar by bytes.

Without ``rich`` (the ``top`` extra) a terminal gets the messages as plain lines.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import IO, Any, Iterator

__all__ = ["Progress", "progress_reporter"]


class _NoTask:
    def advance(self, n: float = 1) -> None:
        pass

    def update(self, **fields: Any) -> None:
        pass


class _Task:
    def __init__(self, progress, task_id):
        self._progress = progress
        self._id = task_id

    def advance(self, n: float = 1) -> None:
        self._progress.advance(self._id, n)

    def update(self, **fields: Any) -> None:
        """``completed=``, ``total=`` or ``description=``."""
        self._progress.update(self._id, **fields)


class Progress:
    """A sink for progress; does nothing when disabled (see :func:`progress_reporter`)."""

    def __init__(self, rich_progress=None, plain: IO[str] | None = None):
        self._rich = rich_progress
        self._plain = plain          # a terminal without rich: messages as lines
        self._status = None

    @property
    def enabled(self) -> bool:
        return self._rich is not None or self._plain is not None

    def __call__(self, message: str) -> None:
        """What runs now (replaces the previous message)."""
        if self._rich is not None:
            if self._status is None:
                self._status = self._rich.add_task(message, total=None)
            else:
                self._rich.reset(self._status, description=message, total=None)
        elif self._plain is not None:
            print(message, file=self._plain, flush=True)

    def task(self, description: str, total: float | None):
        """A bar for ``total`` units of work; call ``advance(n)`` on what this returns."""
        if self._rich is None:
            return _NoTask()
        return _Task(self._rich, self._rich.add_task(description, total=total))

    def reading(self, f: IO[bytes], total: int, description: str) -> IO[bytes]:
        """``f`` as is, or wrapped so that reading it advances a bar of ``total`` bytes."""
        if self._rich is None or total <= 0:
            return f
        return self._rich.wrap_file(f, total=total, description=description)


@contextmanager
def progress_reporter(quiet: bool = False, *, stream: IO[str] | None = None) -> Iterator[Progress]:
    """A :class:`Progress` drawing on ``stream`` (stderr) while the block runs, or a silent one when
    ``quiet`` or when ``stream`` is not a terminal.  The bars vanish at the end."""
    stream = sys.stderr if stream is None else stream
    if quiet or not _is_terminal(stream):
        yield Progress()
        return
    try:
        from rich.console import Console
        from rich.progress import (BarColumn, Progress as RichProgress, SpinnerColumn, TaskProgressColumn,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)
    except ImportError:
        yield Progress(plain=stream)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=30), TaskProgressColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with RichProgress(*columns, console=Console(file=stream), transient=True) as bars:
        yield Progress(bars)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
