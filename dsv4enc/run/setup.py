"""A run's set-up (``RunSetup``): the inputs found, their plan made a window at a time a
bounded distance ahead of the encoder (``Windows``), the decode pool and the decoded stream.

The run streams: inputs are listed as the plan needs them (``RunSetup.more``); each part is
judged by ``--resume`` once its inputs are listed and, while still to do, planned within
``WINDOWS_AHEAD`` parts of the encoder, so the first batch starts while the listing goes on.
What needs every input first lists them whole: ``--update``'s matching and ``--engine ray``
(``headers``), table columns (``find_inputs``) and a single file whose store limits its size."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

from .. import storage
from ..errors import OutputError
from ..output.files import PARTIAL, output_paths
from ..tower.config import VisionConfig
from ..images.decode import NOT_YET, DecodePool, Decoded, DecodeStream
from ..images.discover import Discovery, stream_inputs
from ..images.headers import input_stamps
from ..images.items import InputItem
from ..images.sources import GROUP_CACHE
from .options import EncodeOptions, decode_window, validate, validate_launch
from .plan import Part, Planned, cut_parts, plan_batches, plan_segments, probe_share, with_grids
from .stopping import StopSignals, StoppedWaiting
from .ranks import Topology, launched_ranks

log = logging.getLogger(__name__)

#: Windows (parts to do) planned ahead of the one being encoded: enough that the decode
#: workers never wait for a plan, few enough that memory holds only a few parts' plans.
WINDOWS_AHEAD = 2
_WAIT_S = 0.01  # how long the decode source waits for a window before it says NOT_YET
#: Inputs listed before the first window is planned (a few milliseconds of a folder walk):
#: a smaller input set is listed whole, so its count is known from the start.
LISTED_FIRST = 10_000


@dataclass
class Window:
    """One part's plan: per segment and rank the batches, the decode tasks (``(index, item)``
    in this rank's decode order) and its readable images' patches (for the progress total)."""

    segments: list[Part]
    batches: list[list[list[int]]]
    tasks: list[tuple[int, Any]]
    tokens: int


class Windows:
    """The plan of the parts to do (``todo``; ``count`` is known once it ends), a window (a
    part) at a time, at most ``WINDOWS_AHEAD`` ahead of the encoder. A background thread reads
    each window (``read(part)``: stamps and this rank's header probes, no collective) and, in
    one process, takes and plans it (``finish(part, read)``); under torchrun, where both are
    collectives, the encoder's thread does them one window ahead. The decode source (``tasks``)
    and the encoder (``parts``) each walk the windows; one is dropped once both passed it."""

    def __init__(self, todo: Iterable[Part], read: Callable[[Part], Any],
                 finish: Callable[[Part, Any], Window], *, alone: bool,
                 should_stop: Callable[[], bool] | None = None,
                 idle: Callable[[], bool] | None = None) -> None:
        self._todo, self._read, self._finish, self._alone = iter(todo), read, finish, alone
        self._should_stop = should_stop
        self._idle = idle  # work while the encoder is far behind (False: no more of it)
        self._parts: dict[int, Part] = {}  # taken from ``todo``, not yet planned
        self.count: int | None = None  # how many windows, once ``todo`` has ended
        self._taken = 0
        self._read_done: dict[int, Any] = {}
        self._windows: dict[int, Window] = {}
        self._encoding = self._decoding = 0  # the windows the encoder and the decoder are on
        self._closed = False
        self.blocked = False  # the planner waits for the encoder to come nearer
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="dsv4enc-plan", daemon=True).start()

    def _take(self, k: int) -> None:
        """Take parts from ``todo`` until part ``k`` is taken or ``todo`` has ended."""
        while self._taken <= k and self.count is None:
            part = next(self._todo, None)
            with self._cond:
                if part is None:
                    self.count = self._taken
                else:
                    self._parts[self._taken] = part
                    self._taken += 1
                self._cond.notify_all()

    def _ended(self, k: int) -> bool:
        return self.count is not None and k >= self.count

    def _run(self) -> None:
        try:
            for k in itertools.count():
                while self._idle is not None and k > self._encoding + WINDOWS_AHEAD:
                    if not self._idle():
                        self._idle = None
                with self._cond:
                    while not self._closed and k > self._encoding + WINDOWS_AHEAD:
                        self.blocked = True
                        self._cond.notify_all()
                        self._cond.wait()
                    self.blocked = False
                    if self._closed:
                        return
                if self._alone:
                    self._take(k)
                part = self._wait(lambda: self._parts.get(k) or self._ended(k), stop=False)
                if part is True:
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
                        del self._parts[k]
                    self._cond.notify_all()
        except BaseException as exc:  # raised on the encoder's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], Any], stop: bool = True) -> Any:
        """``ready()`` once it is truthy (the lock held), raising the planner's error;
        ``StoppedWaiting`` when a signal arrives meanwhile (one process)."""
        with self._cond:
            while not (value := ready()):
                if self._error is not None:
                    raise self._error
                signalled = stop and self._should_stop is not None and self._should_stop()
                if self._closed or signalled:
                    raise StoppedWaiting
                self._cond.wait(0.1)
            return value

    def window(self, k: int) -> Window | None:
        """Window ``k`` (under torchrun planned here, with the next one); None past the last."""
        with self._cond:
            self._encoding = k
            self._drop_passed()
            self._cond.notify_all()
        if not self._alone:
            self._take(k + WINDOWS_AHEAD)
            for j in (k, k + 1):
                if not self._ended(j) and j not in self._windows:
                    self._wait(lambda: j in self._read_done, stop=False)
                    window = self._finish(self._parts[j], self._read_done[j])
                    with self._cond:
                        self._windows[j] = window
                        del self._read_done[j], self._parts[j]
                        self._cond.notify_all()
        window = self._wait(lambda: self._windows.get(k) or self._ended(k))
        return None if window is True else window

    def _drop_passed(self) -> None:
        for k in [k for k in self._windows if k < min(self._encoding, self._decoding)]:
            del self._windows[k]

    def parts(self, on_window: Callable[[int, Window], None]) -> Iterator[tuple[Part, list]]:
        """``(segment, its batches per rank)`` in input order, window by window
        (``on_window(k, window)`` first); ends early when a signal arrives while it waits."""
        for k in itertools.count():
            try:
                window = self.window(k)
            except StoppedWaiting:
                return
            if window is None:
                return
            on_window(k, window)
            yield from zip(window.segments, window.batches)

    def tasks(self) -> Iterator:
        """The decode tasks of every window, in order; ``NOT_YET`` while the next window is
        not planned (the decode pump asks again)."""
        for k in itertools.count():
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
                    if self._closed or self._error is not None or self._ended(k):
                        self._decoding = k
                        return
                yield NOT_YET
            yield from window.tasks

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass
class RunSetup:
    """Inputs found (None until ``find_inputs``), every input's entry listed so far
    (``planned``: its item, then its stamp and header once its window is planned), the decode
    pool, and the windows and the decoded stream (``plan_windows``); ``close`` stops them."""

    found: Discovery | None = None
    # the run's clock starts when the set-up was made, or when its maker says (the CLI's process)
    started: float = field(default_factory=time.perf_counter)
    planned: list[Planned] = field(default_factory=list)
    windows: Windows | None = None
    pool: DecodePool | None = None
    decoded: Iterator[tuple[int, Decoded]] | None = None
    listing: Iterator[InputItem] | None = None

    def find_inputs(self, opts: EncodeOptions, stop: StopSignals | None,
                    outputs: Sequence[str] = ()) -> Discovery:
        """Start listing the inputs unless started (``stop``: None under torchrun), and take the
        first: a missing path, an unreadable path list or no image fails here. Table columns or
        kept members list every input: the schema (kept columns' types) and checks need all.
        ``outputs``: where the run writes, which no walk of an input folder lists."""
        if self.found is None:
            check_list_not_out(opts.files_from, opts.out)
            self.found = Discovery()
            self.listing = stream_inputs(
                self.found, opts.inputs, opts.files_from, opts.image_column, opts.key_column,
                stop, table_paths_roots=opts.table_paths_roots, keep_columns=opts.keep_columns,
                keep_members=opts.keep_members, exclude=opts.exclude, outputs=outputs)
            kept = opts.image_column or opts.key_column or opts.keep_columns or opts.keep_members
            self.more(None if kept else 1)
        return self.found

    def more(self, count: int | None) -> None:
        """List until ``planned`` holds ``count`` inputs (None: all) or ``found.listed``."""
        while (count is None or len(self.planned) < count) and not self.found.listed:
            item = next(self.listing, None)
            if item is None:
                break  # listed, or cut short by the error it raised
            self.planned.append(Planned(item))

    def headers(self, cfg: VisionConfig, opts: EncodeOptions, should_stop, announce) -> None:
        """Every input listed, its header, grid and stamp read at once, for what needs the whole
        plan first (``--engine ray``, one process: no ranks); ``announce(text)`` says so."""
        self.more(None)
        announce(f"reading {len(self.planned)} image headers")
        items = [p.item for p in self.planned]
        self.planned[:] = with_grids(items, probe_share(items, opts.max_pixels, None, should_stop,
                                                        opts.decode_timeout), cfg)
        input_stamps(self.planned)

    def cut_parts(self, part_images: int, segment_tokens: int | None) -> list[Part]:
        """Every segment of the whole plan, its headers read (``headers``)."""
        return [segment for part in cut_parts(self.planned, part_images)
                for segment in plan_segments(self.planned, part,
                                             segment_tokens=segment_tokens)]

    def plan_windows(self, todo: Iterable[Part], plan: "WindowSettings", max_images: int,
                     idle: Callable[[], bool] | None = None) -> Windows:
        """The windows of ``todo``, planned from now on (``WindowSettings``: how; ``idle``:
        what the planner does while it is far enough ahead, see ``Windows``), and ``decoded``,
        their images in order (the pool decodes from the first window on)."""
        planned = self.planned
        self.windows = Windows(todo, lambda part: plan.read(planned, part),
                               lambda part, done: plan.finish(planned, part, done),
                               alone=plan.ranks.world_size == 1,
                               should_stop=plan.should_stop, idle=idle)
        self.decoded = self.pool.imap(self.windows.tasks(),
                                      window=decode_window(self.pool.n_workers, max_images))
        return self.windows

    def close(self) -> None:
        """Stop the planner, the stream and the pool (idempotent), and forget the tables' cells
        this process read (inline decodes): a later run here may find a table rewritten."""
        if self.windows is not None:
            self.windows.close()
        if isinstance(self.decoded, DecodeStream):
            self.decoded.close()
        self.decoded = None
        if self.pool is not None:
            self.pool.close()
        GROUP_CACHE.clear()


@dataclass
class WindowSettings:
    """How a window is planned. ``carried``: the inputs ``--update`` carries over (probed
    with their part, for its segments, never decoded); ``unread``: those of them never read
    (``--keep-unlisted``'s rows); ``summary`` counts misnamed images; ``should_stop``: the
    signal check of one process (None under torchrun)."""

    cfg: VisionConfig
    opts: EncodeOptions
    ranks: Topology
    batch_tokens: int
    segment_tokens: int | None
    me: int  # whose batches this process decodes
    summary: Any
    carried: Collection[int] = ()
    unread: Collection[int] = ()
    should_stop: Callable[[], bool] | None = None
    #: called once, with the first window's planned inputs: a single file's size is judged
    #: from them before anything is encoded (the rest of the headers are not read yet)
    check_size: Callable[[Sequence[Planned]], None] | None = None

    def read(self, planned: Sequence[Planned], part: Part) -> Any:
        """Stamp the part's inputs, then probe this rank's share of the headers read (those
        of ``_read``). Any thread; no collective."""
        input_stamps(planned[part.start:part.end])
        return probe_share([planned[i].item for i in self._read(part)], self.opts.max_pixels,
                           self.ranks, self.should_stop, self.opts.decode_timeout)

    def _read(self, part: Part) -> list[int]:
        """The inputs of ``part`` whose headers are read: all but the ``unread``."""
        return [i for i in range(part.start, part.end) if i not in self.unread]

    def finish(self, planned: list[Planned], part: Part, share: Any) -> Window:
        """Plan the part from its probes (``share``; a collective under torchrun): grids,
        segments, batches, and this rank's decode tasks."""
        start, end = part.start, part.end
        read = self._read(part)
        for i, entry in zip(read, with_grids([planned[i].item for i in read], share, self.cfg,
                                             self.ranks, start)):
            entry.stamp = planned[i].stamp
            planned[i] = entry
        self.summary.count_misnamed(planned[start:end])
        if self.check_size is not None:
            check, self.check_size = self.check_size, None
            check(planned[start:end])
        segments = plan_segments(planned, part, self.ranks, self.opts.balance, self.cfg,
                                 self.segment_tokens)
        batches = plan_batches(planned, segments, self.batch_tokens, self.opts.engine.max_images,
                               self.carried, in_order=self.ranks.gathered)
        tasks = [(i, planned[i].item)  # this rank's decode order: part by part, batch by batch
                 for plan in batches for batch in plan[self.me] for i in batch]
        tokens = sum(planned[i].tokens for i in range(start, end)
                     if planned[i].error is None and i not in self.carried)
        return Window(segments, batches, tasks, tokens)


def check_list_not_out(files_from: str | None, out: str) -> None:
    """Refuse, before it is read, a ``--files-from`` list that is the output ``out``, its
    parts' folder or a file in either (links followed): its lines would be the output's bytes."""
    # A URL names no local file (lexists), and a URL --out no local path a list could be on
    local_out = storage.local_path(out)
    if files_from in (None, "-") or not os.path.lexists(files_from) or local_out is None:
        return
    real, output = os.path.realpath(files_from), os.path.realpath(local_out)
    for taken in (output, output + PARTIAL):
        if real == taken or real.startswith(taken + os.sep):
            how = "is" if real == taken else "contains"
            raise OutputError(f"--out {out} {how} the input {files_from} (the --files-from "
                              "list); choose an --out outside the inputs")


def start_prefetch(opts: EncodeOptions, stop: StopSignals | None = None) -> RunSetup | None:
    """Check the options and list the inputs before torch is imported (the errors and their
    order of ``run_encode``): a bad input set fails fast, and nothing is listed twice. None
    under torchrun (each rank lists for itself); ``errors.Interrupted`` on a signal."""
    if launched_ranks() > 1:
        return None
    validate(opts)
    validate_launch(opts, 1)
    setup = RunSetup()
    setup.find_inputs(opts, stop, output_paths(opts.out))
    return setup
