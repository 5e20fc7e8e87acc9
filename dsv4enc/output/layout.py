"""Where a run's output goes and how its parts are committed: the ``--out`` checks, the lock
that keeps two runs off one output, the background part writers, and which parts an
interrupted run already finished.

dsv4enc deletes or replaces only what is provably its own: a single-file ``--out`` that is a
Parquet file with dsv4enc's metadata, and in a parts folder (``OUT.partial/`` or a folder
``--out``) the manifests it recognises by content (``parts.is_manifest``), its part file
names, the growing file (``appending.GROWING_NAME``) and its temporaries. Anything else makes
the run refuse in one line, before anything is written or deleted."""

from __future__ import annotations

import bisect
import contextlib
import errno
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

from ..errors import AlreadyComplete, DsvError, OutputError, UsageError
from ..images.items import is_image_name
from ..images.headers import input_stamps, inputs_digest
from ..pausepoints import pause
from .files import (LOCK_NAME, PART_FILE, PARTIAL, is_output_file, manifest_name,
                    temporary_of, write_probe)
from .update import CUT_SETTINGS, Update, setting_refusal
from .read import read_metadata
from .parts import (PartLedger, PartStore, Row, StreamingAssembler, kept_columns,
                    kept_fields, output_os_error, pre_release_manifest, read_manifest,
                    read_manifests, rows_per_group, rows_to_table)

if TYPE_CHECKING:
    from .appending import AppendingStore

log = logging.getLogger("dsv4enc")

#: flock errors that mean "this file system does not lock", not "someone holds the lock".
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class OutputLock:
    """An exclusive ``flock`` on ``LOCK_NAME`` in the parts folder for the whole run; the file
    names its holder's pid and host (for a second run's refusal). The holder unlinks it, still
    holding it, at the end; a run that locked the old file meanwhile then locks the new one."""

    def __init__(self, folder: Path, out: Path) -> None:
        self.path = folder / LOCK_NAME
        self.out = out
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): nothing to lock with
            log.warning("cannot lock %s on this system: make sure no other dsv4enc run writes "
                        "it at the same time", self.out)
            return
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a run that just ended removed its .partial folder
                self.path.parent.mkdir(parents=True, exist_ok=True)
                continue
            except OSError as exc:
                raise output_os_error(self.path, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise OutputError(f"another dsv4enc run is writing {self.out}{holder}; wait for "
                                  "it to finish or choose another --out") from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKING:
                    os.close(fd)
                    raise output_os_error(self.path, exc) from None
                log.warning("cannot lock %s (%s: file locking is off on this file system); make "
                            "sure no other dsv4enc run writes %s at the same time", self.path,
                            exc.strerror or exc, self.out)
            if _still_linked(fd, self.path):
                self._fd = fd
                _write_holder(fd)
                return
            os.close(fd)  # unlinked by a run that just ended: lock the file there now
        raise OutputError(f"cannot lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        """Unlink the lock file (while still holding it), then let go."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def _still_linked(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _write_holder(fd: int) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    with contextlib.suppress(OSError):  # the lock works without it; the refusal names no pid
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode() + b"\n", 0)


def _holder(fd: int) -> str:
    """`` (pid N on HOST since TIME)`` from a lock file, or "" when it says nothing usable."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f" (pid {int(data['pid'])} on {data['host']}, since {data['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _inside(path: str, folder: str) -> bool:
    """``path`` lies strictly inside ``folder`` (both real, absolute paths)."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def is_dsv4enc_parquet(path: Path) -> bool:
    """A Parquet file whose footer carries dsv4enc's metadata (read from the footer only)."""
    try:
        return read_metadata(path).get("tool") == "dsv4enc"
    except Exception:  # not Parquet, unreadable, ...: not provably ours
        return False


#: How the refusal of an existing output names the two ways to continue it.
_UPDATE_OR_RESUME = ("--update to bring it up to date with the inputs, or --resume to finish "
                     "an interrupted run")


class OutputLayout:
    """Where parts go (``OUT.partial/`` beside a single-file ``--out``, or the ``--out`` folder),
    the checks before anything is computed, the lock, and the clean-up of dsv4enc's files only."""

    def __init__(self, out: str, shard_output: bool) -> None:
        self.out = Path(out)
        self.shard_output = shard_output
        self.folder_mode = shard_output or out.endswith(("/", os.sep)) or self.out.is_dir()
        self.parts_dir = (self.out if self.folder_mode
                          else self.out.with_name(self.out.name + PARTIAL))
        self.lock = OutputLock(self.parts_dir, self.out)
        #: The largest single file the store takes (``RemoteOutput.max_file_bytes``; None: any)
        self.max_file_bytes: int | None = None
        self._made: list[Path] = []  # folders this run created (removed again if left empty)
        self._prepared = False  # this process checked the output (rank 0 under torchrun)

    def interrupted_settings(self, rank: int | None = None) -> dict | None:
        """The settings the interrupted run recorded in this output's manifest (what
        ``--resume`` adopts for ``--dtype auto``), or None when there is no such run."""
        recorded = read_manifest(self.parts_dir / self.manifest_name(rank))
        return recorded["settings"] if recorded else None  # a dict: ``is_manifest`` checks

    def manifest_name(self, rank: int | None = None) -> str:
        """Each rank keeps its own manifest under --shard-output (``rank``: this process's,
        None outside torchrun); merged at the end."""
        return manifest_name(rank if self.shard_output else None)

    # -- what is ours -------------------------------------------------------------------
    def _is_ours(self, name: str, manifests: bool) -> bool:
        """A name in the parts folder that dsv4enc wrote: its lock, its temporaries, and
        (where a dsv4enc manifest is present) its manifests and part files."""
        became = temporary_of(name)
        if name == LOCK_NAME or became is not None and (
                is_output_file(became) or not self.folder_mode and became == self.out.name):
            return True
        return manifests and is_output_file(name)

    def _owned_and_foreign(self, manifests: dict | None = None) -> tuple[list[Path], list[str]]:
        """Files of the parts folder dsv4enc wrote (lock excepted), and the names of the others
        (hidden ones are neither: never deleted, never in the way); ``manifests``: if read."""
        if not self.parts_dir.is_dir():
            return [], []
        ours = bool(read_manifests(self.parts_dir) if manifests is None else manifests)
        owned, foreign = [], []
        for path in sorted(self.parts_dir.iterdir()):
            if self._is_ours(path.name, ours) and not path.is_dir():
                if path.name != LOCK_NAME:
                    owned.append(path)
            elif not path.name.startswith("."):
                foreign.append(path.name)
        return owned, foreign

    def _remove(self, paths: Iterable[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise output_os_error(path, exc) from None

    # -- checks -------------------------------------------------------------------------
    def check_not_inputs(self, inputs: Iterable[str], files_from: str | None) -> None:
        """Refuse an ``--out`` that is an input, holds one, or would be read as one."""
        out = os.path.realpath(self.out)
        parts = os.path.realpath(self.parts_dir)
        sources = [*inputs, *([files_from] if files_from not in (None, "-") else [])]
        for raw in sources:
            if not os.path.lexists(raw):
                continue
            real = os.path.realpath(raw)
            if real in (out, parts):
                raise OutputError(f"--out {self.out} is the input {raw}; choose an --out "
                                  "outside the inputs")
            if _inside(real, parts) or (self.folder_mode and _inside(real, out)):
                raise OutputError(f"--out {self.out} contains the input {raw}; choose an "
                                  "--out outside the inputs")
            if (not self.folder_mode and os.path.isdir(real) and _inside(out, real)
                    and (is_image_name(self.out.name) or is_image_name(out))):
                if os.path.lexists(self.out):
                    raise OutputError(f"--out {self.out} is an input (an image in the input "
                                      f"folder {raw}); choose an --out outside the inputs")
                raise OutputError(f"--out {self.out} has an image name inside the input folder "
                                  f"{raw} (it would be read as an input); choose another --out")

    def check_file_size(self, estimated: int) -> None:
        """Refuse, before anything is encoded, a single file larger than its store takes
        (``estimated``: the run's embedding bytes)."""
        limit = self.max_file_bytes
        if self.folder_mode or limit is None or estimated <= limit:
            return
        raise OutputError(f"--out {self.out} would be one object of about "
                          f"{estimated / 1e9:.0f} GB, more than one upload to its store holds "
                          f"({limit / 1e9:.0f} GB); write a folder output instead (an --out "
                          "ending in /: one object per part)")

    def _check_kinds(self) -> None:
        out = self.out
        for parent in [out.parent, *out.parent.parents]:
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"cannot write {out}: {parent} is a file, not a folder")
        if self.folder_mode and out.exists() and not out.is_dir():
            raise OutputError(f"--out {out} is a file, but a folder output was asked for")
        if not self.folder_mode:
            if self.parts_dir.exists() and not self.parts_dir.is_dir():
                raise OutputError(f"cannot use {self.parts_dir} for parts: it is a file "
                                  "dsv4enc did not write; move it away")
            if out.exists() and not (out.is_file() and is_dsv4enc_parquet(out)):
                raise OutputError(f"--out {out} already exists and is not a dsv4enc output; "
                                  "dsv4enc replaces only its own files: choose another --out")

    def prepare(self, inputs: Iterable[str], files_from: str | None, *, overwrite: bool,
                resume: bool, update: bool = False) -> None:
        """Check ``--out`` against the inputs (``inputs``, ``files_from``) and what is there,
        take the lock (held until ``release``), and with ``overwrite`` delete the earlier
        run's files: only those (``update`` keeps what is there, as ``resume`` does)."""
        self.check_not_inputs(inputs, files_from)
        self._check_kinds()
        self._prepared = True
        try:
            self._make_parts_dir()
            self.lock.acquire()
            self._check_existing(overwrite, resume, update)
        except BaseException:
            self.release()
            raise

    def _check_existing(self, overwrite: bool, resume: bool, update: bool = False) -> None:
        out = self.out
        older = pre_release_manifest(self.parts_dir)
        if older is not None:
            raise OutputError(f"{older} was written by a dsv4enc before 0.1.0, whose outputs "
                              "this version does not read; move it away or choose another --out")
        manifests = read_manifests(self.parts_dir)
        owned, foreign = self._owned_and_foreign(manifests)
        where = f"--out folder {out}" if self.folder_mode else str(self.parts_dir)
        if foreign and not manifests and self.folder_mode:
            raise OutputError(f"--out folder {out} is not empty and holds no dsv4enc output; "
                              "choose another path")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                              if len(foreign) > 3 else "")
            raise OutputError(f"{where} holds files dsv4enc did not write ({shown}); move them "
                              "away or choose another --out")
        if not resume and not overwrite and not update:  # --update: keep all, like --resume
            if not self.folder_mode and out.exists():
                raise OutputError(f"{out} already exists; pass --overwrite to replace it, "
                                  f"{_UPDATE_OR_RESUME}")
            if manifests and self.folder_mode:
                raise OutputError(f"--out folder {out} already holds dsv4enc output; pass "
                                  f"--overwrite to replace it, {_UPDATE_OR_RESUME}")
            if manifests:
                raise OutputError(f"an unfinished run left {self.parts_dir}; pass --resume to "
                                  "continue it or --overwrite to start over")
        if resume and not manifests and not self.folder_mode and out.is_file():
            raise AlreadyComplete(f"{out} is already complete; nothing to resume "
                                  "(pass --overwrite to encode again)")
        if overwrite:
            self._remove(owned)
            return
        # We hold the lock: a killed run's temporaries go, and so do part files no manifest
        # lists (renamed just before a kill), which a folder would show beside their rows.
        listed = {part.get("file") for manifest in manifests.values()
                  for part in manifest["parts"].values()}
        self._remove(p for p in owned if temporary_of(p.name)
                     or (PART_FILE.fullmatch(p.name) and p.name not in listed))

    def _make_parts_dir(self) -> None:
        """Create the parts folder (and missing parents), remembering what was created."""
        missing = [folder for folder in [self.parts_dir, *self.parts_dir.parents]
                   if not folder.exists()]
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None
        self._made = missing  # innermost first

    def create(self) -> None:
        """Check the parts folder is writable (once inputs and weights are known good)."""
        try:
            probe = write_probe(self.parts_dir)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None

    # -- the end of a run -----------------------------------------------------------------
    def remove_parts(self) -> None:
        """The single file is in place: delete the parts and manifest (dsv4enc's only)."""
        self._remove(self._owned_and_foreign()[0])

    def encoding_hint(self, again: str = "--resume") -> str:
        """The one-line hint of a run stopped while it encodes (``resume_hint`` replaces it
        once the writer has committed what it held)."""
        return (f"finished parts are kept in {self.parts_dir}; rerun the same command with "
                f"{again} to finish")

    def resume_hint(self, store: PartLedger, again: str = "--resume") -> str:
        """What an interrupted run leaves, for its one-line message (``again``: the flag
        that finishes it, --resume or --update)."""
        if not store.parts:
            if self.folder_mode:
                return (f"nothing was committed to {self.out} yet; rerun the same command "
                        f"with {again}")
            return "nothing was committed; rerun the same command"
        images = sum(part.get("rows", 0) for part in store.parts.values())
        return (f"{len(store.parts)} finished part{'s' if len(store.parts) > 1 else ''} "
                f"({images} images) kept in {self.parts_dir}; rerun the same command with "
                f"{again} to finish")

    def remove_temporaries(self) -> None:
        """Remove what killed or cancelled writers left under temporary names (we hold the lock)."""
        self._remove(p for p in self._owned_and_foreign()[0] if temporary_of(p.name))

    def discard_if_empty(self) -> None:
        """After a failed run, remove a single-file output's manifest, growing file and
        temporaries if no part was committed (committed parts are kept for --resume)."""
        if self.folder_mode:
            return
        manifests = read_manifests(self.parts_dir)
        owned, _ = self._owned_and_foreign(manifests)
        recorded = any(manifest["parts"] for manifest in manifests.values())
        if not recorded and not any(PART_FILE.fullmatch(p.name) for p in owned):
            self._remove(owned)

    def release(self) -> None:
        """Let go of the lock, and remove the folders this run created if they are empty
        (a ``.partial`` folder left empty is removed too: it is dsv4enc's by name)."""
        if not self._prepared:
            return
        self._prepared = False
        self.lock.release()
        folders = list(self._made)
        if not self.folder_mode and self.parts_dir not in folders:
            folders.insert(0, self.parts_dir)
        self._made = []
        for folder in folders:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break


def open_store(layout: OutputLayout, settings: dict, schema, *, local: bool, is_main: bool,
               world_size: int, rank: int | None, update: Update | None = None,
               rows_settings: dict | None = None, written_elsewhere: bool = False,
               ) -> PartLedger:
    """Where this process commits its parts. One process writing a local single file appends
    each part to it (``appending``), unless ``written_elsewhere`` (``--engine ray``'s actors
    write the part files); otherwise parts are files, joined at the end (``local=False``: the
    staging of an object storage output). ``rank``: this process's under torchrun (None
    outside), for --shard-output's manifests. ``update`` (``rows_settings``: the settings
    that decide its rows): --update's new parts go to its staging store."""
    from . import appending

    staging = update.open_store(settings, rows_settings) if update is not None else None
    if staging is not None:
        return staging

    if (not layout.folder_mode and is_main and local and world_size == 1
            and appending.AVAILABLE and not written_elsewhere):
        return appending.AppendingStore(layout.parts_dir, settings, schema, layout.out)
    return PartStore(layout.parts_dir, settings, layout.manifest_name(rank),
                     drop_cache=layout.folder_mode and local)


def assembler_for(store: PartLedger, layout: OutputLayout, schema, *, is_main: bool):
    """What makes the single file at the end: the appending store, a ``StreamingAssembler`` (a
    single-file output's main process), or None; its ``key_values`` take more footer metadata."""
    from .appending import AppendingStore

    if isinstance(store, AppendingStore):
        store.key_values = {}
        return store
    if not layout.folder_mode and is_main:
        return StreamingAssembler(store, layout.out, schema)
    return None


class PartWriter:
    """Commits parts on background threads (Parquet encoding releases the GIL) so the device
    never waits for Parquet. Consecutive finished segments are joined into one part, committed
    when the plan's part ends or ``store.commit_seconds`` have passed since the last commit (a
    kill loses about that much work); without them each segment is a part."""

    def __init__(self, store: PartStore | AppendingStore, schema, threads: int = 1,
                 assembler: StreamingAssembler | AppendingStore | None = None) -> None:
        self.store = store
        self.schema = schema
        self.assembler = assembler
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=threads)
        self._threads = [threading.Thread(target=self._run, name=f"dsv4enc-writer-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()
        self._rows: list[Row] = []  # the part being joined: its segments' rows so far
        self._name, self._start, self._end = "", 0, 0
        self._since = time.monotonic()  # the last commit (or the start)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue
            began = time.perf_counter()
            try:
                if len(job) == 2:  # a part another process wrote: (name, entry)
                    name, entry = job
                    start, end = entry["start"], entry["end"]
                    self.store.commit_written(name, entry)
                else:
                    name, rows, start, end, digest = job
                    table = rows_to_table(rows, self.schema, self._kept(start, end))
                    group_rows = rows_per_group(self.schema, rows)
                    del job, rows  # the table holds what it needs of them: let the rest go
                    self.store.commit(name, table, group_rows, start, end, digest)
                if self.assembler is not None:  # a StreamingAssembler copies the part
                    self.assembler.notify()
                pause("commit", name=name, start=start, end=end)
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc
            with self._lock:
                self.seconds += time.perf_counter() - began

    def put(self, name: str, rows: list[Row], start: int, end: int, digest: str, *,
            closes: bool) -> None:
        """A finished segment (or, under --shard-output, a whole part); ``closes``: it ends
        its part (what was joined is committed now)."""
        self.check()
        if self.store.commit_seconds is None:
            self._queue.put((name, rows, start, end, digest))
            return
        if self._rows and start != self._end:
            self._flush()
        if not self._rows:
            self._name, self._start = name, start
        self._rows.extend(rows)
        self._end = end
        if closes or time.monotonic() - self._since >= self.store.commit_seconds:
            self._flush()

    def put_written(self, name: str, entry: dict) -> None:
        """A whole part whose file its encoder wrote (``parts.write_part``'s ``entry``):
        committed in the order handed over, as ``PartStore.commit_written`` does."""
        self.check()
        self._queue.put((name, entry))

    def _flush(self) -> None:
        """Commit the joined segments as one part (named after its first segment)."""
        if self._rows:
            job = (self._name, self._rows, self._start, self._end,
                   inputs_digest(self.store.source[self._start:self._end]))
            self._rows = []
            self._queue.put(job)
        self._since = time.monotonic()

    def _kept(self, start: int, end: int) -> dict | None:
        """The kept table columns of inputs ``[start, end)`` (None when the schema has none),
        read from the input tables (a carried row's table is unchanged: its old values)."""
        if not kept_fields(self.schema):  # no input items to gather
            return None
        return kept_columns(self.schema, [p.item for p in self.store.source[start:end]])

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Commit what was handed over (an interrupted run keeps its finished segments)."""
        if self.error is None:
            self._flush()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.check()
        self.store.compact()


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
    committed parts are kept), ``commit_every`` (``PartWriter``'s ``commit_seconds``), and ``row_options``
    (settings besides the model's that decide rows: --resume requires them equal)."""

    resume: bool = False
    flag: str = "--resume"  # the run's flag that keeps committed parts (or --update)
    commit_every: float | None = None
    row_options: dict = field(default_factory=dict)


def _alone(todo_ranges, problem):
    """The agreement of a single process: its own answer."""
    return todo_ranges, problem


class Resume:
    """Which parts are still to encode, judged part by part once their inputs are in
    ``source`` (the run's inputs, growing as they are listed). With ``--resume`` the settings
    are checked here, and a part is kept as far as the committed pieces chaining from its
    start hold the same inputs as now (``headers.inputs_digest``: no header is read) and no
    transient error. ``writes``: this process checks the output; ``agree``: how the ranks
    agree on the ranges to do (``run/ranks.Topology.agree_on_todo``); a problem stops all."""

    def __init__(self, store: PartLedger, source: Sequence, settings: ResumeSettings, *,
                 writes: bool = True, agree: Callable = _alone) -> None:
        self.store, self.writes, self.agree = store, writes, agree
        store.source = source
        store.commit_seconds = settings.commit_every
        self.resuming = False
        self.covered = 0  # where the reused pieces judged so far end
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
            store.create()
            return
        previous = store.load_existing()
        for key, value in store.settings.items():
            if key not in CUT_SETTINGS and previous.get(key) != value:
                raise UsageError(setting_refusal("cannot resume", "the interrupted run used",
                                                 key, previous.get(key), value,
                                                 rerun=" to resume it", again="start over",
                                                 given=settings.flag))
        store.load_parts()  # only now: a refused resume must not judge the parts' files
        store.forget([])  # each part's stale pieces are dropped as it is judged
        self.resuming = True
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
