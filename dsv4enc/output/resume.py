"""Resume: which parts of a run are still to encode, and which an interrupted run finished."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ..errors import DsvError, UsageError
from ..images.headers import input_stamps, inputs_digest
from .files import MANIFEST_NAME, rank_of
from .parts import PartStore, manifest_paths, read_manifest
from .update import check_settings

log = logging.getLogger("dsv4enc")


class Segment(Protocol):
    """What resume needs of a run's part (``run/plan.Part``): its name and input range."""

    name: str
    start: int
    end: int

    def rest(self, start: int) -> "Segment":
        """What is left of the part from ``start`` on."""


@dataclass(frozen=True)
class ResumeSettings:
    """How a run commits and resumes: ``resume`` (--resume or --update, the run's ``flag``:
    committed parts are kept), ``commit_every`` (``commit.PartWriter``'s ``commit_seconds``),
    and ``row_options`` (settings besides the model's that decide rows: --resume requires
    them equal)."""

    resume: bool = False
    flag: str = "--resume"  # the run's flag that keeps committed parts (or --update)
    commit_every: float | None = None
    row_options: dict = field(default_factory=dict)


def _alone(todo_ranges, problem):
    """The agreement of a single process: its own answer."""
    return todo_ranges, problem


def _refuse_other_layout(store: PartStore, flag: str) -> None:
    """Refuse in one line to start over beside the manifest of an interrupted run that
    committed its parts the other way (one per --shard-output rank, or one for the run):
    its part files would stay in the folder, and a glob over them would read rows twice.
    Another --shard-output rank's manifest is checked as this rank's own would be: a rank
    that has none (more ranks than the interrupted run's) must not write one where the
    others refuse."""
    mine_sharded = rank_of(store.manifest_name) is not None
    for path in manifest_paths(store.folder):
        recorded = read_manifest(path)
        if recorded is None or (rank_of(path.name) is not None) == mine_sharded:
            if recorded is not None and mine_sharded:
                check_settings(recorded, store.settings, "cannot resume",
                               "the interrupted run used", rerun=" to resume it",
                               again="start over", given=flag)
            continue
        ran = (f"with --shard-output on {recorded.get('settings', {}).get('world_size', '?')} "
               "torchrun ranks" if not mine_sharded else "without --shard-output")
        raise UsageError(f"cannot resume: {store.folder} holds the parts of a run {ran} "
                         f"({path.name}); resume it the way it ran (or use --overwrite in "
                         f"place of {flag} to start over)")


class Resume:
    """Which parts are still to encode, judged part by part once their inputs are in
    ``source`` (the run's inputs, growing as they are listed). With ``--resume`` the settings
    are checked here, and a part is kept as far as the committed pieces chaining from its
    start hold the same inputs as now (``headers.inputs_digest``: no header is read) and no
    transient error. ``writes``: this process checks the output; ``agree``: how the ranks
    agree on the ranges to do (``run/ranks.Topology.agree_on_todo``); a problem stops all."""

    def __init__(self, store: PartStore, source: Sequence, settings: ResumeSettings, *,
                 writes: bool = True, agree: Callable = _alone) -> None:
        self.store, self.writes, self.agree = store, writes, agree
        store.source = source
        store.commit_seconds = settings.commit_every
        self.resuming = False
        self.complete = False  # the output was finished before this run (not only committed)
        self.covered = 0  # where the reused pieces judged so far end
        self.reused_failed = 0  # the error rows of the pieces kept (as their entries count them)
        self.starts: list[int] = []  # where the recorded pieces start, in order
        problem = None
        if writes:
            try:
                self._open(settings)
            except DsvError as exc:
                problem = exc
        _, problem = agree(None, problem)
        if problem is not None:
            raise problem

    def _open(self, settings: ResumeSettings) -> None:
        store = self.store
        store.settings = {**store.settings, **settings.row_options}
        if not settings.resume or not store.manifest_path.is_file():
            if settings.resume:
                _refuse_other_layout(store, settings.flag)
            store.create()
            return
        previous = store.load_existing()
        check_settings(previous, store.settings, "cannot resume", "the interrupted run used",
                       rerun=" to resume it", again="start over", given=settings.flag)
        store.load_parts()  # only now: a refused resume must not judge the parts' files
        store.forget([])  # each part's stale pieces are dropped as it is judged
        self.resuming = True
        # a sharded folder's merged manifest is written at its run's end only
        self.complete = store.finished or (rank_of(store.manifest_name) is not None
                                           and (store.folder / MANIFEST_NAME).is_file())
        self.starts = sorted(part["start"] for part in store.parts.values())

    def judge(self, part: Segment) -> list[Segment]:
        """What of ``part`` is still to do (itself, its ``rest``, or nothing); the recorded
        pieces in it that are not kept are dropped before it is encoded again."""
        ranges = self._uncommitted(part) if self.writes else None
        ranges, problem = self.agree(ranges, None)
        if problem is not None:
            raise problem
        # The images listed so far: ``dsv4enc inspect`` of an interrupted run says what is left
        self.store.extra["inputs"] = len(self.store.source)
        return [part if start == part.start else part.rest(start) for start, _ in ranges]

    def _uncommitted(self, part: Segment) -> list[tuple[int, int]]:
        if not self.resuming:
            return [(part.start, part.end)]
        store, source = self.store, self.store.source
        at = max(part.start, self.covered)  # a piece begun in an earlier part may reach here
        kept = set()
        while at < part.end and (piece := store.committed_at(at)) is not None:
            name, end = piece
            if end > len(source):
                break  # reaches past the inputs listed: encoded again
            input_stamps(source[at:end])
            if not store.committed(name, at, end, inputs_digest(source[at:end])):
                break
            kept.add(name)
            self.reused_failed += store.parts[name].get("failed", 0)
            at = self.covered = end
        self._forget(part.start, part.end, kept)
        return [(at, part.end)] if at < part.end else []

    def _forget(self, start: int, end: int | None, kept: set[str]) -> None:
        """Drop the recorded pieces that start in ``start..end`` (None: on) but ``kept``."""
        first = bisect.bisect_left(self.starts, start)
        last = len(self.starts) if end is None else bisect.bisect_left(self.starts, end)
        names = [name for at in self.starts[first:last]
                 if (piece := self.store.committed_at(at)) is not None
                 and (name := piece[0]) not in kept]
        if names:
            self.store.drop(names)

    def end(self, inputs: int) -> None:
        """The listing has ended at ``inputs``: drop the recorded pieces past it, and name
        the parts whose input files changed."""
        self.store.extra["inputs"] = inputs
        if not self.resuming:
            return
        self._forget(inputs, None, set())
        store = self.store
        if store.changed:
            log.warning("%d finished part%s encoded again: %s input files changed (size, time "
                        "or permissions) since the interrupted run", store.changed,
                        "s are" if store.changed > 1 else " is",
                        "their" if store.changed > 1 else "its")
