"""Progress on stderr: a bar on a terminal, a plain line every few seconds in a log file.

Every figure is counted per batch (under torchrun: summed over all ranks by the caller) and
has one definition, shared with the end-of-run summary (README.md, "Progress and the
summary"): rates are per second of the encoding loop, and the ETA is the tokens left at that
rate (images, until every token to encode is known), so that a run of large images is not
estimated from its small ones. A ``+`` marks a total of what is listed or planned so far."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, RenderableColumn, TextColumn
from rich.text import Text

from ..pausepoints import armed, pause
from .options import LOG_EVERY_S

#: Every line it prints quotes paths and messages: ``:name:`` in them is text, not an emoji
stderr_console = Console(stderr=True, emoji=False)


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``-:--:--`` when unknown)."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class ProgressCounts:
    """What the run has done so far (this run's work; ``reused`` images came from earlier)."""

    total_images: int = 0
    total_tokens: int = 0
    reused: int = 0
    images: int = 0
    tokens: int = 0
    failed: int = 0
    elapsed: float = 0.0
    tokens_known: bool = True  # total_tokens counts every image to encode (all planned)
    images_known: bool = True  # total_images counts every input (the listing has ended)

    @property
    def images_per_s(self) -> float:
        return self.images / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.tokens and self.total_tokens and self.tokens_known:
            return max(self.total_tokens - self.tokens, 0) / self.tokens_per_s
        if self.images and self.total_images and self.images_known:
            return max(self.total_images - self.reused - self.images, 0) / self.images_per_s
        return None

    @property
    def more(self) -> str:
        """``+`` while the token total is of the windows planned so far."""
        return "" if self.tokens_known else "+"

    @property
    def of_images(self) -> str:
        """``done/total`` images, ``+`` while the listing goes on."""
        return (f"{self.reused + self.images}/{self.total_images}"
                f"{'' if self.images_known else '+'}")

    def fields(self) -> list[str]:
        """The bar's figures, the most telling first."""
        return [f"{self.of_images} images", f"eta {format_duration(self.eta_s)}",
                f"{self.images_per_s:.1f} img/s", f"{self.tokens_per_s:,.0f} tokens/s",
                f"{self.failed} failed", f"{self.tokens:,}/{self.total_tokens:,}{self.more} tokens",
                f"encoding for {format_duration(self.elapsed)}"]

    def line(self) -> str:
        """The plain progress line of a log file."""
        done = self.reused + self.images
        share = 100 * done / self.total_images if self.total_images else 100.0
        share_text = f" ({share:.1f}%)" if self.images_known else ""
        return (f"images {self.of_images}{share_text}, "
                f"tokens {self.tokens:,}/{self.total_tokens:,}{self.more}, "
                f"{self.images_per_s:.1f} img/s, {self.tokens_per_s:,.0f} tokens/s, "
                f"{self.failed} failed, encoding for {format_duration(self.elapsed)}, "
                f"eta {format_duration(self.eta_s)}")


class RunProgress:
    """Progress of one run on stderr. ``mode``: ``bar`` (a rich bar, for a terminal),
    ``log`` (a plain line every ``log_every`` seconds, for nohup/SLURM logs), ``off`` (other
    ranks, ``--quiet``), or ``auto`` (``bar`` when stderr is a terminal, else ``log``)."""

    def __init__(self, mode: str = "auto", log_every: float = LOG_EVERY_S) -> None:
        if mode == "auto":
            try:
                mode = "bar" if sys.stderr.isatty() else "log"
            except (AttributeError, ValueError):  # no stderr, or a closed one
                mode = "log"
        self.mode = mode
        self.log_every = log_every
        self.counts = ProgressCounts()
        self._status = "starting"
        self._counting = False
        self._began = time.perf_counter()
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._task = None
        self._ticker: threading.Thread | None = None
        self._closed = threading.Event()
        self._frozen: float | None = None  # encoding seconds, once the loop is over

    def __enter__(self) -> "RunProgress":
        self._began = time.perf_counter()
        if self.mode == "bar":
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(bar_width=16),
                RenderableColumn(self), console=stderr_console, transient=False,
                refresh_per_second=4)  # the figures: ``__rich__``, drawn at each refresh
            self._progress.__enter__()
            self._task = self._progress.add_task("starting", total=None)
        elif self.mode == "log":
            self._closed.clear()
            self._ticker = threading.Thread(target=self._tick, name="dsv4enc-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
            if self._counting:  # where the log's progress ended (a short run's only line)
                _print(self.snapshot().line())
        if self._progress is not None:
            self._progress.refresh()
            self._progress.__exit__(*exc)
            self._progress = None

    def announce(self, text: str) -> None:
        """One line about the run (what it will do, what it adopted), in every mode but ``off``."""
        if self.mode == "bar":
            stderr_console.print(f"dsv4enc: {escape(text)}", highlight=False, soft_wrap=True)
        elif self.mode == "log":
            _print(text)

    def status(self, text: str) -> None:
        """What the run is doing before (or instead of) encoding."""
        with self._lock:
            self._status = text
        self._bar(description=text)

    def start(self, total: int | None, done: int = 0, tokens: int | None = None) -> None:
        """Switch to counting: ``total`` images (None: told as they are listed,
        ``listed``), ``done`` of them finished by an earlier run, ``tokens`` ViT tokens to
        encode in this one (None: told window by window, ``plan_tokens``)."""
        with self._lock:
            self.counts = ProgressCounts(total_images=total or 0, total_tokens=tokens or 0,
                                         reused=done, tokens_known=tokens is not None,
                                         images_known=total is not None)
        self._bar(total=total, completed=done, refresh=True)

    def listed(self, inputs: int, ended: bool, reused: int = 0) -> None:
        """``inputs`` are listed so far (``ended``: all of them), ``reused`` more of them
        finished by an earlier run."""
        with self._lock:
            self.counts.total_images = inputs
            self.counts.images_known = ended
            self.counts.reused += reused
        self._bar(total=inputs if ended else None, advance=reused)

    def plan_tokens(self, tokens: int, last: bool = False) -> None:
        """A window was planned: its ``tokens`` join the total (``last``: it is complete)."""
        with self._lock:
            self.counts.total_tokens += tokens
            self.counts.tokens_known = self.counts.tokens_known or last

    def begin_encoding(self) -> None:
        """The encoding loop starts now: rates are measured from here."""
        with self._lock:
            self._counting = True
            self._began = time.perf_counter()
        self.status("encoding")

    def end_encoding(self) -> None:
        """The encoding loop is over: rates and time stop here, before the final file."""
        with self._lock:
            if self._counting:
                self._frozen = time.perf_counter() - self._began

    def advance(self, images: int, tokens: int, failed: int, dropped_tokens: int = 0) -> None:
        """Images (``failed`` of them failed) and tokens finished since the last call;
        ``dropped_tokens`` were planned for images that then failed to decode."""
        with self._lock:
            self.counts.images += images
            self.counts.tokens += tokens
            self.counts.failed += failed
            self.counts.total_tokens -= dropped_tokens
        self._bar(advance=images, refresh=True)  # per batch: a bar that moves 4 times a second lags
        if armed("encoded"):  # a test stops the run here, after the rows it counted
            counts = self.snapshot()
            pause("encoded", done=counts.reused + counts.images, total=counts.total_images)

    def settle(self, summary) -> None:
        """The run stopped: its figures become the ``summary.RunSummary``'s, which counts
        the rows kept. Images are counted here per batch, so a part begun and then dropped
        by the stop would leave the last line claiming images that were never written."""
        with self._lock:
            counts = self.counts
            counts.reused, counts.failed = summary.reused, summary.failed
            counts.images, counts.tokens = summary.encoded + summary.failed, summary.tokens
        self._bar(completed=counts.reused + counts.images, refresh=True)

    def snapshot(self) -> ProgressCounts:
        with self._lock:
            counts = ProgressCounts(**vars(self.counts))
            if self._frozen is not None:
                counts.elapsed = self._frozen
            elif self._counting:
                counts.elapsed = time.perf_counter() - self._began
            return counts

    def _fields(self) -> list[str]:
        c = self.snapshot()
        return c.fields() if c.total_images or self._counting else []

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The bar's figures, computed when it is drawn (so time and ETA move between
        batches): as many whole ones, the most telling first, as fit the line (a narrow
        terminal drops the last ones instead of wrapping one)."""
        yield Text(fitted(self._fields(), options.max_width), no_wrap=True, overflow="crop")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        fields = self._fields()
        return Measurement(len(fields[0]) if fields else 0, len(_GAP.join(fields)))

    def _bar(self, **changes) -> None:
        if self._progress is not None:
            self._progress.update(self._task, **changes)

    def _tick(self) -> None:
        # a wait takes at most TIMEOUT_MAX (--log-every inf: only the line where it ends)
        while not self._closed.wait(min(self.log_every, threading.TIMEOUT_MAX)):
            with self._lock:
                counting, status = self._counting, self._status
            _print(self.snapshot().line() if counting
                   else f"{status} ({format_duration(time.perf_counter() - self._began)})")


_GAP = "  "  # between two of the bar's figures


def fitted(fields: list[str], width: int) -> str:
    """The first ``fields`` that fit ``width`` columns whole, joined by ``_GAP``."""
    shown = ""
    for field in fields:
        joined = f"{shown}{_GAP}{field}" if shown else field
        if len(joined) > width:
            break
        shown = joined
    return shown


def _print(text: str) -> None:
    print(f"dsv4enc: {text}", file=sys.stderr, flush=True)
