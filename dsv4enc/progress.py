"""The progress bar on stderr: images, img/s, tokens/s and ETA (rich)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

stderr_console = Console(stderr=True)


class RunProgress:
    """A rich progress bar on stderr, or nothing when disabled (other ranks, --quiet)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = None
        self._began = time.perf_counter()
        self._base = 0

    def __enter__(self) -> "RunProgress":
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
                TimeRemainingColumn(), console=stderr_console, transient=False,
                refresh_per_second=4)
            self._progress.__enter__()
            self._task = self._progress.add_task("starting", total=None, rate="")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def status(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def start(self, total: int, done: int = 0) -> None:
        """Switch to counting images; ``done`` were finished by an earlier run."""
        self._began = time.perf_counter()
        self._base = done
        if self._progress is not None:
            self._progress.update(self._task, description="encoding", total=total,
                                  completed=done)

    def advance(self, n: int, summary) -> None:
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self._began, 1e-9)
        images = summary.encoded + summary.failed
        rate = f"{images / elapsed:.1f} img/s {summary.tokens / elapsed:,.0f} tok/s"
        self._progress.update(self._task, advance=n, rate=rate)
