"""SIGINT and SIGTERM: stop any phase of a run within moments, with exit code 128 + signal.

Before encoding starts (discovery, header probes, planning, model loading) nothing must finish:
the first signal raises ``Interrupted`` at once, wherever the main thread is (a blocked wait
included). While parts are encoded and committed it is only recorded (``deferred``): the loop
stops between batches, its finished parts kept for ``--resume``. A second Ctrl-C stops at once.
In a process the command owns, a run still going ``FORCE_EXIT_S`` after the first signal (a
hung worker, a peer rank gone) is ended there, its committed parts kept."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from contextlib import contextmanager, suppress
from typing import Callable, Iterator

from ..errors import Interrupted

BEFORE_ENCODING_HINT = "stopped before encoding began; rerun the same command"
#: Seconds a run may take to stop after a signal before the process ends at once (a signal
#: ends any run within 10 s; committed parts survive a kill).
FORCE_EXIT_S = 8.0


class StopSignals:
    """Records SIGINT/SIGTERM for the run (installed from the main thread only). ``immediate``:
    the first signal raises ``Interrupted(signum, hint)``; else it only sets ``signum``.
    ``force_exit_s``: the process's own command only (never an in-process caller's): the
    seconds after the first signal at which the process exits, however far the stop got."""

    def __init__(self, immediate: bool = True, force_exit_s: float | None = None) -> None:
        self.signum: int | None = None
        self.immediate = immediate
        self.hint = BEFORE_ENCODING_HINT
        self.force_exit_s = force_exit_s
        self._previous: dict[int, object] = {}
        self._deadline: threading.Timer | None = None
        #: What the process's own command does before a forced exit ends it (its report)
        self.last_words: Callable[[Interrupted], None] | None = None

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

    def reinstall(self) -> None:
        """The run's handlers back over those a library installed since ``install`` (``ray.init``
        sets its own SIGTERM handler); ``restore`` still restores those ``install`` found."""
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def requested(self) -> bool:
        """A signal arrived (for polling loops, and for threads other than the main one)."""
        return self.signum is not None

    def check(self) -> None:
        """Raise ``Interrupted`` if a signal arrived."""
        if self.signum is not None:
            raise Interrupted(self.signum, self.hint)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            return
        self.signum = signum
        if self.force_exit_s is not None:
            self._deadline = threading.Timer(self.force_exit_s, self._force_exit)
            self._deadline.daemon = True
            self._deadline.start()
        if self.immediate:
            raise Interrupted(signum, self.hint)

    def _force_exit(self) -> None:
        """The run did not stop in time: say so in its one line and end the process (its
        decode workers first, which a hung one would outlive)."""
        stopped = Interrupted(self.signum, self.hint)
        line = (f"error: {stopped} (the run did not stop within {self.force_exit_s:g} s of "
                "the signal: ended at once)")
        for child in multiprocessing.active_children():
            child.kill()
        try:
            if self.last_words is not None:
                with suppress(Exception):  # the line and the exit come whatever it does
                    self.last_words(stopped)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + self.signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside: a signal is only recorded (the caller stops at its next safe point)."""
        previous, self.immediate = self.immediate, False
        try:
            yield
        finally:
            self.immediate = previous

    def restore(self) -> None:
        """The previous handlers back; a stop under way has ended (no forced exit)."""
        if self._deadline is not None:
            self._deadline.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class StoppedWaiting(Exception):
    """A signal arrived while the encoding loop waited (for a decoded image or a plan)."""
