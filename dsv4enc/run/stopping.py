"""SIGINT and SIGTERM: stop any phase of a run within moments, with exit code 128 + signal.

Before encoding starts (discovery, header probes, planning, model loading) nothing must finish:
the first signal raises ``Interrupted`` at once, wherever the main thread is (a blocked wait
included). While parts are encoded and committed it is only recorded (``deferred``): the loop
stops between batches, its finished parts kept for ``--resume``. A second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from ..errors import Interrupted

BEFORE_ENCODING_HINT = "stopped before encoding began; rerun the same command"


class StopSignals:
    """Records SIGINT/SIGTERM for the run (installed from the main thread only). ``immediate``:
    the first signal raises ``Interrupted(signum, hint)``; else it only sets ``signum``."""

    def __init__(self, immediate: bool = True, hint: str = BEFORE_ENCODING_HINT) -> None:
        self.signum: int | None = None
        self.immediate = immediate
        self.hint = hint
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

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
        if self.immediate:
            raise Interrupted(signum, self.hint)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside: a signal is only recorded (the caller stops at its next safe point)."""
        previous, self.immediate = self.immediate, False
        try:
            yield
        finally:
            self.immediate = previous

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class StoppedWaiting(Exception):
    """A signal arrived while the encoding loop waited (for a decoded image or a plan)."""
