"""Every input's header, read before any pixel is decoded, and what identifies the inputs:
the header probes of a run (threads with a time limit per probe), the inputs with their grids
(``Planned``), and the stamps and digests that ``--resume`` compares. Torch-free."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from .. import storage
from .decode import Probe, probe_image
from .formats import DEFAULT_DECODE_TIMEOUT_S
from .items import InputItem

PROBE_THREADS = 16  # header probes run at once (they mostly wait on storage)
PROBE_TIMEOUT_S = DEFAULT_DECODE_TIMEOUT_S  # one header may take this long before it is given up
PROBE_POLL_S = 0.1  # how often the waiting thread checks for a stop and for late probes
STAT_THREADS = 16  # file stamps taken at once (a stat mostly waits on network shares)


@dataclass(slots=True)  # one per input of the run: no __dict__ each
class Planned:
    """One input, and once its header was read its grid, or why it cannot be encoded."""

    item: InputItem
    width: int | None = None
    height: int | None = None
    n_h: int = 0
    n_w: int = 0
    error: str | None = None
    stamp: str | None = None  # its file as planned (``input_stamps``): what --resume checks
    misnamed: str | None = None  # the format it is, when its name says another (``Probe``)

    @property
    def tokens(self) -> int:
        return self.n_h * self.n_w


# ----------------------------------------------------------------------------- probes

class _Probers:
    """The daemon threads of one ``probe_all``, each probing the next item; a probe past its time
    limit gets an error (``give_up_late``), its thread (unkillable) abandoned and replaced."""

    def __init__(self, items: Sequence[InputItem], max_pixels: int) -> None:
        self.items, self.max_pixels = items, max_pixels
        self.results: list[Probe | None] = [None] * len(items)
        self.remaining = len(items)
        self.halt = threading.Event()
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._next = iter(range(len(items)))
        self._running: dict[int, tuple[float, int]] = {}  # index -> (start time, serial)
        self._abandoned: set[int] = set()  # serials of threads replaced after a timeout
        self._serials = iter(range(1 << 62))

    def spawn(self) -> None:
        threading.Thread(target=self._work, args=(next(self._serials),),
                         name="dsv4enc-probe", daemon=True).start()

    def _take(self, serial: int) -> int | None:
        with self._lock:
            if serial in self._abandoned or self.halt.is_set():
                return None
            index = next(self._next, None)
            if index is not None:
                self._running[index] = (time.monotonic(), serial)
            return index

    def _work(self, serial: int) -> None:
        while (index := self._take(serial)) is not None:
            probe = probe_image(self.items[index], self.max_pixels)
            with self._lock:
                self._running.pop(index, None)
            self._finished.put((index, probe))

    def collect(self, wait_s: float) -> None:
        """Take every finished probe, waiting up to ``wait_s`` for the first."""
        got = []
        with contextlib.suppress(queue.Empty):
            got.append(self._finished.get(timeout=wait_s))
            while True:
                got.append(self._finished.get_nowait())
        for index, probe in got:
            if self.results[index] is None:  # None: not given up already
                self.results[index] = probe
                self.remaining -= 1

    def give_up_late(self, timeout_s: float) -> None:
        """Error results for probes past ``timeout_s``; their threads are replaced."""
        now = time.monotonic()
        with self._lock:
            for index, (began, serial) in list(self._running.items()):
                if now - began > timeout_s:
                    del self._running[index]
                    self._abandoned.add(serial)
                    error = f"header read timed out after {timeout_s:g}s"
                    self.results[index] = Probe(error=error)
                    self.remaining -= 1
                    self.spawn()


def probe_all(items: Sequence[InputItem], max_pixels: int,
              should_stop: Callable[[], bool] | None = None,
              timeout_s: float | None = PROBE_TIMEOUT_S,
              threads: int = PROBE_THREADS) -> list[Probe]:
    """``probe_image`` of every item, in order, on ``threads`` daemon threads: one past
    ``timeout_s`` gets an error (``_Probers``), and once ``should_stop()`` is true the ones not
    done get an "interrupted" one. The calling thread waits on a queue with a short timeout, so
    a signal handler that raises stops it at once. Not ``concurrent.futures``: its workers are
    joined at exit (a stuck probe would hold it up), and a Future per header is heavy."""
    probers = _Probers(items, max_pixels)
    for _ in range(min(threads, len(items))):
        probers.spawn()
    checked = time.monotonic()
    try:
        while probers.remaining and (should_stop is None or not should_stop()):
            probers.collect(PROBE_POLL_S)  # all that are done: the timing checks once per poll
            if timeout_s is not None and time.monotonic() - checked >= PROBE_POLL_S:
                checked = time.monotonic()
                probers.give_up_late(timeout_s)
    finally:
        probers.halt.set()
    return [Probe(error="interrupted before its header was read") if r is None else r
            for r in probers.results]


# ----------------------------------------------------------------------------- stamps and digests

def input_stamps(planned: Sequence[Planned]) -> None:
    """Set each entry's ``stamp`` once, before decoding starts (a file changed afterwards never
    matches its part's stamp: --resume encodes it again); a container's image takes its stamp."""
    todo = [entry for entry in planned if entry.stamp is None]
    containers: dict[str, str] = {}
    for entry in todo:  # one stat per container file, however many images it holds
        if entry.item.member is not None:
            if entry.item.path not in containers:
                containers[entry.item.path] = storage.stamp(entry.item.path)
            entry.stamp = containers[entry.item.path]
    files = [entry for entry in todo if entry.item.member is None]
    with ThreadPoolExecutor(max_workers=STAT_THREADS) as pool:
        for entry, stamp in zip(files, pool.map(lambda e: storage.stamp(e.item.path), files,
                                                chunksize=256)):
            entry.stamp = stamp


def inputs_digest(planned: Sequence[Planned]) -> str:
    """Digest of the entries' keys, then of their file stamps: ``KEYS.FILES``."""
    files = hashlib.blake2b(digest_size=12)
    for entry in planned:
        files.update((entry.stamp or "").encode() + b"\0")
    return f"{keys_digest([entry.item for entry in planned])}.{files.hexdigest()}"


def keys_digest(items: Sequence[InputItem]) -> str:
    """Digest of the items' keys (the ``KEYS`` of ``inputs_digest``)."""
    keys = hashlib.blake2b(digest_size=12)
    for item in items:
        keys.update(item.key.encode("utf-8", "surrogateescape") + b"\0")
    return keys.hexdigest()
