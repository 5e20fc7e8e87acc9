"""A run's set-up (``RunSetup``): the inputs found, their plan made a window at a time a
bounded distance ahead of the encoder (``Windows``), the decode pool and the decoded stream.
One holder owns it and closes it once: ``run_encode`` closes the set-up it is given or makes.

The run streams: once the inputs are listed (their keys: what the parts are cut from), each
part still to encode (a range of inputs cut by input order alone, ``plan.cut_parts``) is
planned when the encoder comes within ``WINDOWS_AHEAD`` parts of it: its inputs stamped,
its headers read on the probe threads (``plan.probe_share``: the seam of the probes), its
segments cut and balanced over the ranks, its batches packed, and its images handed to the
decode workers. The first batch starts once the first window is planned, whatever the
dataset's size; what is kept for every input is its item and its stamp.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Sequence

from ..tower.config import VisionConfig
from ..images.decode import NOT_YET, DecodePool, Decoded, DecodeStream
from ..images.discover import Discovery, discover
from ..images.headers import input_stamps
from ..engine.defaults import default_batch_tokens
from .options import EncodeOptions, decode_window, default_workers, validate
from .plan import (Part, Planned, cut_parts, decode_order, plan_batches, plan_segments,
                   probe_share, with_grids)
from .stopping import StopSignals, StoppedWaiting
from .ranks import Topology, launched_ranks

log = logging.getLogger(__name__)

#: Windows (parts to do) planned ahead of the one being encoded: enough that the decode
#: workers never wait for a plan, few enough that memory holds only a few parts' plans.
WINDOWS_AHEAD = 2
_WAIT_S = 0.01  # how long the decode source waits for a window before it says NOT_YET


@dataclass
class Window:
    """One part's plan: its segments, per segment and rank the batches, the decode tasks
    (``(index, item)`` in this rank's decode order) and the patches its readable images
    have (what the progress adds to its total)."""

    segments: list[Part]
    batches: list[list[list[int]]]
    tasks: list[tuple[int, Any]]
    tokens: int


class Windows:
    """The plan of the parts to do, one window (a part) at a time, at most
    ``WINDOWS_AHEAD`` ahead of the encoder. A background thread reads each window
    (``read(part)``: stamps and this rank's header probes, no collective) and, in one
    process, plans it (``finish(part, read)``); under torchrun the encoder's thread plans
    each window (a collective shares the probes) one window ahead of the one it encodes,
    so that the ranks agree on every window. The decode source (``tasks``) and the encoder
    (``parts``) each walk the windows; a window is dropped once both have passed it."""

    def __init__(self, todo: list[Part], read: Callable[[Part], Any],
                 finish: Callable[[Part, Any], Window], *, alone: bool,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.todo, self._read, self._finish, self._alone = todo, read, finish, alone
        self._should_stop = should_stop
        self._read_done: dict[int, Any] = {}
        self._windows: dict[int, Window] = {}
        self._encoding = self._decoding = 0  # the windows the encoder and the decoder are on
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dsv4enc-plan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for k, part in enumerate(self.todo):
                with self._cond:
                    while not self._closed and k > self._encoding + WINDOWS_AHEAD:
                        self._cond.wait()
                    if self._closed:
                        return
                done = self._read(part)
                if self._should_stop is not None and self._should_stop():
                    return  # headers left unread must not be planned as error rows
                window = self._finish(part, done) if self._alone else None
                with self._cond:
                    if window is None:
                        self._read_done[k] = done
                    else:
                        self._windows[k] = window
                    self._cond.notify_all()
        except BaseException as exc:  # raised on the encoder's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], Any], stop: bool = True) -> Any:
        """``ready()`` once it is not None (the lock held), raising the planner's error;
        ``StoppedWaiting`` when a signal arrives meanwhile (one process)."""
        with self._cond:
            while (value := ready()) is None:
                if self._error is not None:
                    raise self._error
                if stop and self._should_stop is not None and self._should_stop():
                    raise StoppedWaiting
                self._cond.wait(0.1)
            return value

    def window(self, k: int) -> Window:
        """Window ``k``, for the encoder (under torchrun planned here, with the next one)."""
        with self._cond:
            self._encoding = k
            self._drop_passed()
            self._cond.notify_all()
        if not self._alone:
            for j in (k, k + 1):
                if j < len(self.todo) and j not in self._windows:
                    done = self._wait(lambda: self._read_done.get(j), stop=False)
                    window = self._finish(self.todo[j], done)
                    with self._cond:
                        self._windows[j] = window
                        del self._read_done[j]
                        self._cond.notify_all()
        return self._wait(lambda: self._windows.get(k))

    def _drop_passed(self) -> None:
        for k in [k for k in self._windows if k < min(self._encoding, self._decoding)]:
            del self._windows[k]

    def parts(self, on_window: Callable[[int, Window], None]) -> Iterator[tuple[Part, list]]:
        """``(segment, its batches per rank)`` in input order, window by window
        (``on_window(k, window)`` first); ends early when a signal arrives while it waits."""
        for k in range(len(self.todo)):
            try:
                window = self.window(k)
            except StoppedWaiting:
                return
            on_window(k, window)
            yield from zip(window.segments, window.batches)

    def tasks(self) -> Iterator:
        """The decode tasks of every window, in order; ``NOT_YET`` while the next window is
        not planned (the decode pump asks again)."""
        for k in range(len(self.todo)):
            while True:
                with self._cond:
                    window = self._windows.get(k)
                    if window is None and not self._closed and self._error is None:
                        self._cond.wait(_WAIT_S)
                        window = self._windows.get(k)
                    if window is not None:
                        self._decoding = k
                        self._drop_passed()
                        break
                    if self._closed or self._error is not None:
                        return
                yield NOT_YET
            yield from window.tasks
        with self._cond:
            self._decoding = len(self.todo)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class RunSetup:
    """Inputs found (None until ``find_inputs``), every input's entry (``entries``: its
    item, then its stamp and header once its window is planned), the windows of the parts
    to do, the decode pool and the decoded stream. Each is made once, by the method that
    returns it."""

    found: Discovery | None = None
    # The run's clock (``time.perf_counter``) starts here: when the set-up was made, or what
    # its maker says (the command line: when the process started).
    started: float = field(default_factory=time.perf_counter)
    planned: list[Planned] | None = None
    windows: Windows | None = None
    pool: DecodePool | None = None
    decoded: Iterator[tuple[int, Decoded]] | None = None

    def find_inputs(self, opts: EncodeOptions, stop: StopSignals | None) -> Discovery:
        """The inputs, found now unless found already (``stop``: None under torchrun,
        where the ranks stop together)."""
        if self.found is None:
            self.found = discover(opts.inputs, opts.files_from, opts.image_column,
                                  opts.key_column, stop,
                                  table_paths_roots=opts.table_paths_roots,
                                  keep_columns=opts.keep_columns)
        return self.found

    def entries(self) -> list[Planned]:
        """One entry per input, in input order (headers unread until its window is planned)."""
        if self.planned is None:
            self.planned = [Planned(item) for item in self.found.items]
        return self.planned

    def decode_pool(self, cfg: VisionConfig, device_type: str, opts: EncodeOptions) -> DecodePool:
        """The decode pool, of ``--workers`` or the device's default (spawned now: its
        workers start while the model loads)."""
        if self.pool is None:
            workers = default_workers(device_type) if opts.workers is None else opts.workers
            self.pool = DecodePool(cfg, workers, opts.max_pixels, opts.decode_timeout)
        return self.pool

    def headers(self, cfg: VisionConfig, opts: EncodeOptions, ranks: Topology | None,
                should_stop, announce) -> list[Planned]:
        """Every input's header and grid at once, and its stamp, for what needs the whole
        plan first (``--update``'s matching, ``--engine ray``); ``announce(text)`` says so."""
        planned = self.entries()
        announce(f"reading {len(planned)} image headers")
        items = [p.item for p in planned]
        planned[:] = with_grids(items, probe_share(items, opts.max_pixels, ranks, should_stop,
                                                   opts.decode_timeout), cfg, ranks)
        input_stamps(planned)
        return planned

    def cut_parts(self, part_images: int, ranks: Topology | None, balance: str,
                  cfg: VisionConfig, segment_tokens: int | None) -> list[Part]:
        """Every segment of the whole plan, its headers read (``headers``)."""
        return [segment for part in cut_parts(self.planned, part_images)
                for segment in plan_segments(self.planned, part, ranks, balance, cfg,
                                             segment_tokens)]

    def plan_windows(self, todo: list[Part], plan: "WindowSettings") -> Windows:
        """The windows of ``todo``, planned from now on (``WindowSettings``: how)."""
        if self.windows is None:
            planned = self.entries()
            self.windows = Windows(todo, lambda part: plan.read(planned, part),
                                   lambda part, done: plan.finish(planned, part, done),
                                   alone=plan.ranks.world_size == 1,
                                   should_stop=plan.should_stop)
        return self.windows

    def stream(self, max_images: int) -> Iterator[tuple[int, Decoded]]:
        """The decoded images, in the windows' order (started now)."""
        if self.decoded is None:
            self.decoded = self.pool.imap(self.windows.tasks(),
                                          window=decode_window(self.pool.n_workers, max_images))
        return self.decoded

    def close(self) -> None:
        """Stop the planner, the stream and the pool (idempotent)."""
        if self.windows is not None:
            self.windows.close()
        if isinstance(self.decoded, DecodeStream):
            self.decoded.close()
        self.decoded = None
        if self.pool is not None:
            self.pool.close()


@dataclass
class WindowSettings:
    """How a window is planned: the tower's config, the run's options and ranks, the
    batches' and segments' sizes, the inputs ``--update`` carries over (whose headers were
    all read first: ``headers_read``), the summary that counts misnamed images, and the
    signal check of one process (None under torchrun)."""

    cfg: VisionConfig
    opts: EncodeOptions
    ranks: Topology
    batch_tokens: int
    segment_tokens: int | None
    me: int  # whose batches this process decodes
    summary: Any
    carried: Collection[int] = ()
    headers_read: bool = False
    should_stop: Callable[[], bool] | None = None
    #: called once, with the first window's planned inputs: a single file's size is judged
    #: from them before anything is encoded (the rest of the headers are not read yet)
    check_size: Callable[[Sequence[Planned]], None] | None = None

    def read(self, planned: Sequence[Planned], part: Part) -> Any:
        """Stamp the part's inputs, then probe this rank's share of its headers (None when
        they were read already). Any thread; no collective."""
        input_stamps(planned[part.start:part.end])
        if self.headers_read:
            return None
        items = [p.item for p in planned[part.start:part.end]]
        return probe_share(items, self.opts.max_pixels, self.ranks, self.should_stop,
                           self.opts.decode_timeout)

    def finish(self, planned: list[Planned], part: Part, share: Any) -> Window:
        """Plan the part from its probes (``share``; a collective under torchrun): grids,
        segments, batches, and this rank's decode tasks."""
        start, end = part.start, part.end
        if share is not None:
            entries = with_grids([p.item for p in planned[start:end]], share, self.cfg,
                                 self.ranks)
            for entry, old in zip(entries, planned[start:end]):
                entry.stamp = old.stamp
            planned[start:end] = entries
        self.summary.count_misnamed(planned[start:end])
        if self.check_size is not None:
            check, self.check_size = self.check_size, None
            check(planned[start:end])
        segments = plan_segments(planned, part, self.ranks, self.opts.balance, self.cfg,
                                 self.segment_tokens)
        batches = plan_batches(planned, segments, self.batch_tokens, self.opts.max_images,
                               self.carried)
        order = decode_order(batches, self.me)
        tokens = sum(planned[i].tokens for i in range(start, end)
                     if planned[i].error is None and i not in self.carried)
        return Window(segments, batches, [(i, planned[i].item) for i in order], tokens)


def run_batch_tokens(opts: EncodeOptions, device_type: str) -> int:
    """Patches per batch of a run on ``device_type``: ``--batch-tokens`` or the engine's
    default."""
    return opts.batch_tokens or default_batch_tokens(device_type)


def start_prefetch(opts: EncodeOptions, stop: StopSignals | None = None) -> RunSetup | None:
    """Check the options and list the inputs before torch is imported (the same errors, in
    the same order, as ``run_encode``), so that a bad input set fails fast and nothing is
    walked or read from stdin twice. Returns None under torchrun (each rank lists for
    itself); raises ``errors.Interrupted`` when ``stop`` records a signal meanwhile."""
    if launched_ranks() > 1:
        return None
    validate(opts)
    setup = RunSetup()
    setup.find_inputs(opts, stop)
    return setup
