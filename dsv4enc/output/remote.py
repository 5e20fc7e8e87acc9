"""``--out`` in object storage (``s3://bucket/out.parquet``, ``s3://bucket/out/``).

Object stores have no rename or append, so a run's manifest is kept in a local staging folder
by the same code as any local output and mirrored to the store in a crash-safe order: a part
object whole, then the commit record that lists it, and a single file as one object at the end
(``storage.upload_file_whole``). The commit record is the manifest object, uploaded when the
run writes its manifest whole, and its journal's new lines, one segment object per sync
(``Mirror``): a sync costs its new commits, however many came before. A folder output's parts are
uploaded by their writers (``attach``) and never staged; a single file's are staged, for its
join. Before the run, the output's dsv4enc objects are brought into the staging folder, or
named there (``RemoteOutput.pull``), so that the local checks decide as for a local path.
docs/object-storage.md tells the whole protocol."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from .. import storage
from ..errors import DsvError, OutputError
from .files import (LOCK_NAME, MANIFEST_FILE, MANIFEST_NAME, PART_FILE, PARTIAL, SEGMENT_FILE,
                    STAMPS_FILE, is_ours, journal_path, rank_of, segment_name, staging_folder)
from .lock import HEARTBEAT_S, BucketLock, process_alive
from .parts import (PartStore, listed_files, listed_names, read_manifest, read_manifests,
                    store_failure)
from .read import is_dsv4enc_parquet, journal_entries, load_manifest, opens_journal

log = logging.getLogger("dsv4enc")
T = TypeVar("T")

#: Seconds between syncs (a sync costs its new commits: the manifest is uploaded whole only
#: when the run writes it whole).
SYNC_S = 0.5
#: Staging folders are ``STAGING_PREFIX`` + a random tail in the temporary folder, marked by
#: ``STAGING_MARK`` (the output's URL, the host and the process): only a marked folder of this
#: output whose process is gone is removed by a later run (``remove_stale_staging``).
STAGING_PREFIX = "dsv4enc-staging-"
STAGING_MARK = ".dsv4enc-staging.json"


class RemoteOutput:
    """The local staging of a URL ``--out`` and its mirroring to the store (see the module)."""

    def __init__(self, out: str, *, writer: bool, inputs: Sequence[str] = (),
                 resume: bool = False, update: bool = False, overwrite: bool = False,
                 shard_output: bool = False, rank: int = 0, world_size: int = 1,
                 gather: Callable[[Any], list[Any]] | None = None) -> None:
        """``out``: the URL; ``writer``: this process touches the store (rank 0, or every rank
        sharded); ``inputs``, ``resume``, ``update``, ``overwrite``, ``shard_output``: the
        run's; ``rank``, ``world_size``: this process's place among torchrun's ranks;
        ``gather(value)``: every rank's ``value`` in rank order (``run/ranks.Topology.gather``;
        this process's alone by default)."""
        self.given = out
        self.url = out.rstrip("/")
        self.inputs, self.resume, self.update = list(inputs), resume, update
        self.overwrite, self.writer = overwrite, writer
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self._gather = gather if gather is not None else (lambda value: [value])
        # --shard-output of torchrun ranks: every rank writes its own parts and manifest
        self.sharded = bool(shard_output) and world_size > 1
        # Raised by ``pull``, which every rank waits for (rank 0 failing alone here would
        # leave the other ranks waiting in a collective)
        self._problem: DsvError | None = None
        self.folder_mode = out.endswith("/") or bool(shard_output)
        if self.is_main and not self.folder_mode:
            try:
                self.folder_mode = storage.kind(out) == "folder"
            except DsvError as exc:
                self._problem = exc
        self.parts_url = self.url if self.folder_mode else self.url + PARTIAL
        self.staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX))
        mark = {"url": self.url, "host": socket.gethostname(), "pid": os.getpid()}
        (self.staging / STAGING_MARK).write_text(json.dumps(mark))
        name = self.url.rsplit("/", 1)[-1] or "out"
        self.local_out = self.staging / name
        self.local_parts = self.local_out if self.folder_mode else \
            self.staging / f"{name}{PARTIAL}"
        #: The ``--out`` the run writes to instead: the staging folder's output.
        self.staged_out = str(self.local_out) + ("/" if self.folder_mode else "")
        self._uploaded: dict[str, tuple[int, int]] = {}  # part name -> (size, mtime_ns)
        self._in_store: set[str] = set()  # parts their writers put in the store themselves
        self._mirrors: dict[str, Mirror] = {}  # manifest name -> what the store holds of it
        self._seen: dict[str, tuple] = {}  # manifest name -> its files' state when uploaded
        self.lock = BucketLock(storage.join(self.parts_url, LOCK_NAME), self.url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock_mutex = threading.Lock()
        # --overwrite: the earlier run's manifests (their staged state when pulled), replaced
        # or deleted before a part upload (``drop_replaced``)
        self._replaced: dict[str, tuple] = {}
        #: --resume or --update of a folder: the part objects left in the store, by name
        self.stored: dict[str, storage.ObjectInfo] = {}
        #: A folder's --update stopped or failed with parts committed in its staging (its own
        #: or a stopped one's it took over): ``close`` keeps it
        self._keep_update = False

    @property
    def max_file_bytes(self) -> int | None:
        """The largest single file this store takes in one upload (None: a folder, or no limit)."""
        return None if self.folder_mode else storage.max_object_bytes(self.url)

    @classmethod
    def for_out(cls, out: str, **settings) -> "RemoteOutput | None":
        """The remote output for a URL ``out`` (``settings``: the constructor's), None if local."""
        return cls(out, **settings) if storage.local_path(out) is None else None

    # -- whose files -------------------------------------------------------------------------
    def _mine(self, name: str) -> bool:
        """Whether this rank mirrors the manifest or part ``name``: every one, unless each rank
        writes its own (``files.rank_of``)."""
        return not self.sharded or rank_of(name) == self.rank

    def _every_rank(self, action: Callable[[], None]) -> None:
        """``action()`` on every rank, then every rank raises the first rank's error (a
        collective: no rank is left waiting for one that gave up)."""
        problem = None
        try:
            action()
        except DsvError as exc:
            problem = exc
        except OSError as exc:
            problem = store_failure(self.url, exc)
        problem = next((p for p in self._gather(problem) if p is not None), None)
        if problem is not None:
            raise problem

    def run(self, encode: Callable[[], T],
            main_then_all: Callable[[Callable[[], None]], None]) -> T:
        """``encode()`` (writing to the staging folder) between ``pull`` and ``finish``; a
        failed run leaves its committed parts in the store. Messages name the store.
        ``main_then_all(action)``: ``pull`` on rank 0, its error on every rank (``run/ranks``).
        The log lines of the run name the store as its messages do (``told_about_store``)."""
        log.addFilter(self.told_about_store)
        try:
            main_then_all(self.pull)
            if self.sharded:
                self._every_rank(self.pull_own)
            if self.writer:  # mirror committed parts and manifests in the background
                self._thread = threading.Thread(target=self._loop, name="dsv4enc-upload",
                                                daemon=True)
                self._thread.start()
            try:
                summary = encode()
            except BaseException as exc:
                self.abandon(quiet=isinstance(exc, storage.StoreDown))
                raise
            self.finish()
            if self.writer:  # the output is committed: a killed run's staging is of no use
                self.remove_stale_staging()
        except BaseException as exc:
            # a failure anywhere (the pull too, once it took a stopped update's parts over)
            # keeps the parts an update committed here: ``close`` leaves them for a rerun
            self._keep_update = self.writer and self._staged_update() is not None
            if isinstance(exc, storage.StoreDown):
                # finished parts this rank's manifests in the store list; its flag told by the run
                exc.keep(sum(mirror.parts for mirror in self._mirrors.values()), self.parts_url)
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (self.translate(exc.args[0]), *exc.args[1:])
            if getattr(exc, "summary", None) is not None:  # a stop's, for --summary-json
                exc.summary.out = self.given
            raise
        finally:
            log.removeFilter(self.told_about_store)
        if hasattr(summary, "out"):
            summary.out = self.given
        return summary

    # -- before the run --------------------------------------------------------------------
    def pull(self) -> None:
        """Check the inputs against the output, take the lock object, and bring the output's
        dsv4enc state into the staging folder (its manifests, its parts with ``--resume`` or
        ``--update``, empty stand-ins for the final file and foreign objects) for the checks."""
        if self._problem is not None:
            raise self._problem
        try:
            self._pull()
        except OSError as exc:
            raise storage.setup_error(self.url, exc) from None

    def _pull(self) -> None:
        self._check_not_inputs()
        self.lock.take()
        what = storage.kind(self.url)
        self._refuse_the_other_form(what)
        if self.update and self.folder_mode:  # what a stopped update committed, kept here
            self._adopt_staged_update()
        if self.resume or self.update:  # the store has what the killed run committed
            self.remove_stale_staging()
        if not self.folder_mode and what == "file":
            if self.update:  # its rows are read: the file itself, not a stand-in
                self._download(self.url, self.local_out)
            else:
                self._stand_in_final_file()
            if self.resume:  # a finished file is judged by its rows' keys, read where it is
                name = self.local_out.name
                self.stored[name] = storage.ObjectInfo(self.url, name, None, None)
        objects = [o for o in storage.list_files(self.parts_url)
                   if o.key != LOCK_NAME and o.url != self.url]
        if not objects:
            return
        self.local_parts.mkdir(parents=True, exist_ok=True)
        segments = _segment_paths(objects)
        listed, judged = None, False  # what the manifests list (they sort before the parts)
        for obj in objects:
            top = "/" not in obj.key
            if top and (MANIFEST_FILE.fullmatch(obj.key) or STAMPS_FILE.fullmatch(obj.key)):
                self._fetch(obj, segments)
            elif top and SEGMENT_FILE.fullmatch(obj.key):
                self._note_segment(obj.key)
            elif top and PART_FILE.fullmatch(obj.key):
                if not judged:
                    listed, judged = self._listed_parts(), True
                self._pull_part(obj, listed)
            elif not obj.key.startswith("."):  # foreign: the local checks name it
                (self.local_parts / obj.key.split("/", 1)[0]).touch()
        self._note_manifests()
        if self.sharded and self.overwrite:
            # Before any rank uploads a part, the manifests no rank of this run replaces go (the
            # merged one, those of ranks it lacks): none may list a part replaced meanwhile.
            for obj in objects:
                rank = rank_of(obj.key)
                if MANIFEST_FILE.fullmatch(obj.key) and (rank is None or rank >= self.world_size):
                    storage.delete(obj.url)

    def _refuse_the_other_form(self, what: str) -> None:
        """A single file and a folder output of one name (``what``: the name's ``kind``) are one
        output, as on a local disk: a folder run refuses beside the file, or while a single-file
        run holds its lock object; a single-file run, while a folder run holds its. Each looks
        once it holds its own lock, so of two that start at once, one sees the other."""
        if self.folder_mode and what == "file":
            raise OutputError(f"--out {self.given} is a file, but a folder output was asked for")
        if self.folder_mode or what == "folder":
            other = self.url + PARTIAL if self.folder_mode else self.url
            BucketLock(storage.join(other, LOCK_NAME), self.url).refuse_if_held()

    def _listed_parts(self) -> set[str] | None:
        """The files the pulled manifests list (None: there is no manifest)."""
        documents = read_manifests(self.local_parts)
        return listed_names(documents.values()) if documents else None

    def _pull_part(self, obj: storage.ObjectInfo, listed: set[str] | None) -> None:
        """Judge a part object: one no manifest lists and whose footer is not dsv4enc's is
        another's (its stand-in a folder, which the local checks name); dsv4enc's stay in the
        store for ``--resume`` and ``--update``, or are brought here, or stand in empty."""
        if listed is not None and obj.key not in listed and not is_dsv4enc_parquet(obj.url):
            (self.local_parts / obj.key).mkdir()
        elif self._mine(obj.key) and self._leave_in_store(obj):
            return
        elif (self.resume or self.update) and self._mine(obj.key):
            self._fetch(obj)
        else:  # an empty stand-in: the local checks see the name
            (self.local_parts / obj.key).touch()

    def pull_own(self) -> None:
        """--shard-output, every rank but 0 (whose ``pull`` did it): bring this rank's own
        manifest into its staging folder, and with ``--resume`` its own parts."""
        if self.is_main:
            return
        try:
            objects = [o for o in storage.list_files(self.parts_url)
                       if "/" not in o.key and self._mine(o.key)]
        except OSError as exc:
            raise storage.setup_error(self.url, exc) from None
        self.local_parts.mkdir(parents=True, exist_ok=True)
        segments = _segment_paths(objects)
        for obj in objects:
            if MANIFEST_FILE.fullmatch(obj.key) or (self.resume and PART_FILE.fullmatch(obj.key)
                                                     and not self._leave_in_store(obj)):
                self._fetch(obj, segments)
            elif SEGMENT_FILE.fullmatch(obj.key):
                self._note_segment(obj.key)
        self._note_manifests()

    def _leave_in_store(self, obj: storage.ObjectInfo) -> bool:
        """Record a part object that ``--resume`` or ``--update`` of a folder reuses in
        ``stored`` and return True: it stays in the store, judged by its size and read in place
        where its rows are. False (nothing recorded) where it must be brought here: a single
        file's parts, which the file is joined from, or a run that reuses none."""
        if not (self.folder_mode and (self.resume or self.update)):
            return False
        self.stored[obj.key] = obj
        self._in_store.add(obj.key)
        return True

    def attach(self, store: PartStore, written_elsewhere: bool) -> None:
        """Tie the run's ``store`` to the bucket: a part that an actor uploaded
        (``written_elsewhere``) is adopted, and a folder output's parts are written straight to
        the store by the writer, each object whole, so the staging folder never holds them
        (an ``--update`` stages its new parts until its switch)."""
        writes_to_store = self.folder_mode and not self.update
        if written_elsewhere or writes_to_store:
            store.fetch = self.adopt_part
        if writes_to_store:
            store.part_folder, store.stored = self.parts_url, self.stored

    def _fetch(self, obj: storage.ObjectInfo, segments: Sequence[str] = ()) -> None:
        """Bring a top-level object of the parts folder into the staging folder: a manifest
        with its journal's segments (among ``segments``, the listed ones' paths) applied; a
        part or stamps file, which counts as uploaded as long as it is unchanged."""
        path = self.local_parts / obj.key
        if not MANIFEST_FILE.fullmatch(obj.key):
            self._download(obj.url, path)
            self._uploaded[obj.key] = _local_id(path)
            return
        fs, where = storage.filesystem(obj.url)
        try:
            document = load_manifest(where, fs, segments)
        except ValueError:  # another tool's object under that name: the local checks judge it
            self._download(obj.url, path)
            return
        path.write_text(json.dumps(document, indent=1, sort_keys=True))

    def _mirror(self, manifest: str) -> "Mirror":
        return self._mirrors.setdefault(manifest, Mirror(manifest))

    def _note_segment(self, key: str) -> None:
        """A journal segment the store holds before the run: this rank's replace it."""
        manifest = SEGMENT_FILE.fullmatch(key).group(1) + ".json"
        if self._mine(manifest):
            self._mirror(manifest).stale.add(key)

    def _note_manifests(self) -> None:
        """The store's manifests (this rank's), as the staging folder now holds them: in step
        with the store until the run writes them again."""
        for path in self.local_parts.iterdir():
            if MANIFEST_FILE.fullmatch(path.name) and self._mine(path.name):
                mirror, document = self._mirror(path.name), read_manifest(path) or {}
                mirror.base, mirror.token = _local_state(path)[0], document.get("journal")
                mirror.parts = len(document.get("parts", {}))
                if self.overwrite:
                    self._replaced[path.name] = mirror.base

    def _check_not_inputs(self) -> None:
        for raw in self.inputs:
            for place in {self.url, self.parts_url}:
                if storage.lies_within(raw, place) or \
                        (self.folder_mode and storage.lies_within(place, raw)):
                    raise OutputError(f"--out {self.url} overlaps the input {raw}; choose an "
                                      "--out outside the inputs")

    def _stand_in_final_file(self) -> None:
        """A local file that answers the local checks as the remote final file would: an
        empty Parquet file with its schema (a dsv4enc output or not), or empty bytes."""
        import pyarrow.parquet as pq

        try:
            with storage.open_input(self.url) as handle:
                schema = pq.read_schema(handle)
            pq.write_table(schema.empty_table(), self.local_out)
        except Exception as exc:  # not Parquet (a foreign object), unless the store failed
            if isinstance(exc, OSError) and storage.setup_problem(exc):
                raise storage.setup_error(self.url, exc) from None
            self.local_out.write_bytes(b"")

    def _download(self, url: str, path: Path) -> None:
        try:
            storage.download(url, path)
        except OSError as exc:
            raise OutputError(storage.describe(url, exc)) from None

    # -- during the run ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Sync and refresh the lock until the run ends. A failed round is logged once and
        tried again; the run's end syncs once more and fails if that fails too."""
        beat = time.monotonic()
        while not self._stop.wait(SYNC_S) and self.lock.lost is None:
            try:
                self.sync()
                if time.monotonic() - beat > HEARTBEAT_S:
                    self.lock.refresh()
                    beat = time.monotonic()
            except Exception as exc:
                if self._error is None:
                    log.warning("uploading to %s failed (%s); trying again",
                                self.parts_url, storage.describe(self.parts_url, exc))
                self._error = exc

    def sync(self) -> None:
        """Upload each part a local manifest lists that is not in the store yet, then the record
        that lists it: the manifest object when the run wrote it whole, else its journal's new
        lines as a segment (``Mirror``); the store's record never lists a part it lacks."""
        with self._lock_mutex:
            if not self.local_parts.is_dir():
                return
            for manifest in sorted(self.local_parts.iterdir()):
                if not MANIFEST_FILE.fullmatch(manifest.name) or not self._mine(manifest.name):
                    continue
                state = _local_state(manifest)
                if self._seen.get(manifest.name) == state or state[0] is None:
                    continue  # neither the manifest nor its journal changed since, or it is gone
                mirror = self._mirror(manifest.name)
                try:
                    if state[0] != mirror.base:
                        self._upload_base(manifest, mirror, state[0])
                    self._upload_journal(manifest, mirror)
                except FileNotFoundError:
                    continue  # the run removed its parts meanwhile (the final file is made)
                self._seen[manifest.name] = state

    def _upload_base(self, manifest: Path, mirror: "Mirror", state: tuple) -> None:
        """Upload a manifest the run wrote whole (the parts it lists first), then delete the
        segments of the journal it replaces."""
        content = manifest.read_bytes()
        document = json.loads(content)
        for name in listed_files(document):
            self._upload_part(name)
        storage.upload(storage.join(self.parts_url, manifest.name), content)
        replaced = mirror.objects()
        mirror.restart(state, document.get("journal"), len(document.get("parts", {})))
        for key in replaced:
            storage.delete(storage.join(self.parts_url, key))

    def _upload_journal(self, manifest: Path, mirror: "Mirror") -> None:
        """Upload the journal's whole lines written since the last sync as one segment (the parts
        they list first), then merge the newest segments while two cover as many syncs."""
        read = _journal_bytes(manifest, mirror.token, mirror.read)
        if read is None:
            return
        header, start, data = read
        entries = list(journal_entries(header + data, mirror.token or ""))
        for entry in entries:
            if isinstance(entry.get("part", {}).get("file"), str):
                self._upload_part(entry["part"]["file"])
        first = mirror.segments[-1][1] + 1 if mirror.segments else 1
        span = (first, first, start, start + len(data))
        storage.upload(storage.join(self.parts_url, mirror.name(span)), header + data)
        mirror.segments.append(span)
        mirror.read = start + len(data)  # a resume's drops count down
        mirror.parts += sum(1 if "part" in entry else -len(entry["drop"]) for entry in entries)
        while mirror.mergeable():
            (a, _, begin, _), (_, b, _, end) = mirror.segments[-2:]
            read = _journal_bytes(manifest, mirror.token, begin, end)
            if read is None:
                break  # the run wrote its manifest whole meanwhile: the next sync uploads it
            old = [mirror.name(span) for span in mirror.segments[-2:]]
            span = (a, b, begin, end)
            storage.upload(storage.join(self.parts_url, mirror.name(span)), read[0] + read[2])
            mirror.segments[-2:] = [span]  # only once the merged one is stored
            for key in old:  # one left by a failed delete is passed over: a reader takes the
                storage.delete(storage.join(self.parts_url, key))  # furthest-reaching

    def sync_parts(self) -> None:
        """The single file is made and its staged parts are about to go: the store gets the
        ones the background sync has not sent yet, so that an upload of the file that is
        stopped or fails leaves every part in ``OUT.partial`` for the rerun, as its line says
        (they went unsent, all of them in a short run). A sync that fails leaves that to the
        upload, which fails in its own line."""
        if self.writer:
            with contextlib.suppress(OSError):
                self.sync()

    def adopt_part(self, name: str, path: Path) -> None:
        """Part file ``name`` was uploaded by the process that wrote it (the writer or a ray
        actor): never uploaded again; brought to ``path`` only where the final file is joined
        from it. A run whose lock another run took over stops here (``BucketLock.check``)."""
        self.lock.check()
        self._in_store.add(name)
        if not self.folder_mode:
            self._download(storage.join(self.parts_url, name), path)

    def drop_replaced(self) -> None:
        """Once the run has written its manifests, and before any part object is uploaded (by
        this process or the actors: a part may take an old name), put them in place of the
        earlier run's that ``--overwrite`` replaces (one upload each, so a reader finds a
        manifest throughout and never reads the folder as plain Parquet), and delete the
        earlier run's that it does not write."""
        for manifest, pulled in sorted(self._replaced.items()):
            if _local_state(self.local_parts / manifest)[0] not in (None, pulled):
                self.sync()  # the run wrote it: its upload replaces the old one
            else:
                storage.delete(storage.join(self.parts_url, manifest))
            del self._replaced[manifest]

    def _upload_part(self, name: str) -> None:
        """Upload a staged part unless the store has it."""
        if name in self._in_store:
            return
        path = self.local_parts / name
        ident = _local_id(path)
        if self._uploaded.get(name) != ident:
            self.drop_replaced()
            storage.upload_file(path, storage.join(self.parts_url, name))
            self._uploaded[name] = ident

    # -- the end of the run ----------------------------------------------------------------
    def _stop_loop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        """The run succeeded: upload what is left (the final file as one object), then delete
        the store's parts no longer in the output (sharded: rank 0 uploads the merged manifest)."""
        self._stop_loop()
        if not self.writer:
            return
        self.lock.check()
        try:
            if self.sharded:
                self._every_rank(self.sync)
                if self.is_main:
                    merged = self.local_parts / MANIFEST_NAME
                    storage.upload(storage.join(self.parts_url, MANIFEST_NAME),
                                   merged.read_bytes())
                    self._delete_unlisted([MANIFEST_NAME])
            elif self.folder_mode:
                self.sync()
                self._delete_unlisted(list(self._mirrors))
            else:
                storage.upload_file_whole(self.local_out, self.url)  # whole, or none
                for obj in storage.list_files(self.parts_url):
                    if is_ours(obj.key):
                        storage.delete(obj.url)
                self.lock.release()
                storage.remove_empty_prefix(self.parts_url)
        except OSError as exc:
            raise store_failure(self.url, exc) from None

    def abandon(self, quiet: bool = False) -> None:
        """The run failed or stopped: its committed parts go to the store (``--resume``), a
        manifest it removed locally is deleted there. ``quiet``: the store is down (the run
        says so)."""
        self._stop_loop()
        if not self.writer or self.lock.lost is not None:  # the output is another run's now
            return
        try:
            self.sync()
            for name, mirror in self._mirrors.items():
                if not (self.local_parts / name).exists():
                    for key in [name, *mirror.objects()]:
                        storage.delete(storage.join(self.parts_url, key))
        except OSError as exc:
            if not quiet:
                log.error("%s", storage.describe(self.parts_url, exc))

    def _delete_unlisted(self, manifests: list[str]) -> None:
        """Delete the part objects none of ``manifests`` (local names) lists, and the journal
        segments: a finished output's manifests are whole."""
        listed = listed_names(read_manifest(self.local_parts / manifest) or {}
                              for manifest in manifests)
        for obj in storage.list_files(self.parts_url):
            if (PART_FILE.fullmatch(obj.key) or STAMPS_FILE.fullmatch(obj.key)) \
                    and obj.key not in listed or SEGMENT_FILE.fullmatch(obj.key):
                storage.delete(obj.url)

    def close(self) -> None:
        """Release the lock object and remove the staging folder (this run's own)."""
        self._stop_loop()
        try:
            if self.writer:
                self.lock.release()
        except OSError as exc:  # the store is down (said already) or the lock goes stale
            if storage.outage_cause(exc) is None:
                log.warning("could not delete the lock object %s (%s)", self.lock.url,
                            storage.describe(self.lock.url, exc))
        finally:
            if not self._keep_update:  # else a later --update here takes its parts over
                shutil.rmtree(self.staging, ignore_errors=True)

    def remove_stale_staging(self) -> None:
        """Remove the staging folders that earlier runs of this output left when they were
        killed or, an update's, stopped: marked for its URL on this host by a process that is
        gone (this run holds the output's lock; a live rank's folder stays). Unmarked folders
        are never touched."""
        for folder in self._stale_staging():
            shutil.rmtree(folder, ignore_errors=True)

    def _stale_staging(self) -> list[Path]:
        """The staging folders of this output that a process now gone left on this host,
        the newest first."""
        found = []
        with contextlib.suppress(OSError):
            for folder in self.staging.parent.glob(f"{STAGING_PREFIX}*"):
                try:
                    mark = json.loads((folder / STAGING_MARK).read_text())
                    when = (folder / STAGING_MARK).stat().st_mtime_ns
                except (OSError, ValueError):
                    continue
                if (folder != self.staging and isinstance(mark, dict)
                        and mark.get("url") == self.url
                        and mark.get("host") == socket.gethostname()
                        and not process_alive(mark.get("pid"))):
                    found.append((when, folder))
        return [folder for _, folder in sorted(found, reverse=True)]

    def _staged_update(self, local_out: Path | None = None) -> Path | None:
        """The staging folder of a folder's --update (beside ``local_out``, this run's by
        default) where its manifest lists a committed part, else None."""
        folder = staging_folder(local_out or self.local_out)
        if not self.folder_mode or not (read_manifest(folder / MANIFEST_NAME) or {}).get("parts"):
            return None
        return folder

    def _adopt_staged_update(self) -> None:
        """A folder's --update builds its new parts here until its end: an update of this
        output that was stopped or killed on this host left them in its staging folder, which
        this run takes over (``update.Update.open_store`` reuses it where it updates the same
        output state, so the rerun encodes only what is left)."""
        for folder in self._stale_staging():
            staged = self._staged_update(folder / self.local_out.name)
            if staged is not None:
                os.rename(staged, staging_folder(self.local_out))
                return

    def told_about_store(self, record: logging.LogRecord) -> bool:
        """A log line of the run (a damaged part found by --resume or --update, say) about the
        staging folder, told about the store as ``translate`` tells a message: the staging
        folder is a temporary folder of this machine that the user never gave."""
        message = record.getMessage()
        told = self.translate(message)
        if told != message:
            record.msg, record.args = told, ()
        return True

    def translate(self, text: str) -> str:
        """A message about the staging folder, told about the store in one pass (a path before
        one that begins it); but the parts a stopped --update of a folder keeps are on this
        machine (``close`` keeps them)."""
        update = str(staging_folder(self.local_out))
        here = (f" kept on this machine in {update} (a folder's update uploads them when it "
                "ends; a rerun here reuses them);")  # (a message translated twice is as once)
        told = {f" kept in {update};": here, here: here, update: self.parts_url,
                str(self.local_parts): self.parts_url, str(self.local_out): self.url}
        return re.sub("|".join(map(re.escape, told)), lambda found: told[found[0]], text)


@dataclass
class Mirror:
    """What the store holds of one local manifest: the manifest as the run last wrote it whole (its
    ``journal`` token), then the journal's lines as segments, each of the lines one or more syncs
    added (``files.segment_name``). Two segments that cover as many syncs are merged into one, so a
    reader reads O(log syncs) of them and a line is uploaded O(log syncs) times."""

    manifest: str  # its name (``_manifest.json``)
    base: tuple | None = None  # the local manifest's file state when it was uploaded
    token: str | None = None  # its journal token
    parts: int = 0  # the parts the store's record lists
    read: int = 0  # bytes of the local journal uploaded
    #: the segments, oldest first: first and last sync, and the journal's bytes they hold
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    stale: set[str] = field(default_factory=set)  # segments the store held before the run

    def name(self, span: tuple[int, int, int, int]) -> str:
        return segment_name(self.manifest, self.token or "", span[0], span[1])

    def objects(self) -> list[str]:
        """The segment objects of this manifest in the store, stale ones too."""
        return sorted(self.stale) + [self.name(span) for span in self.segments]

    def mergeable(self) -> bool:
        if len(self.segments) < 2:
            return False
        (a, b, _, _), (c, d, _, _) = self.segments[-2:]
        return b - a == d - c

    def restart(self, base: tuple, token: Any, parts: int) -> None:
        """The store now holds the manifest written whole at ``base`` (under ``token``)."""
        self.base, self.token, self.parts = base, token if isinstance(token, str) else None, parts
        self.read, self.segments, self.stale = 0, [], set()


def _journal_bytes(manifest: Path, token: str | None, start: int,
                   end: int | None = None) -> tuple[bytes, int, bytes] | None:
    """The header of ``manifest``'s local journal and its whole lines from byte ``start`` (at least
    past the header) to ``end`` (None: the last whole line), with where they begin; None where
    there are none, or the journal is not ``token``'s (the manifest was written whole since)."""
    if token is None:
        return None
    try:
        with open(journal_path(manifest), "rb") as journal:
            header = journal.readline()
            if not header.endswith(b"\n") or not opens_journal(header, token):
                return None
            start = max(start, len(header))
            journal.seek(start)
            data = journal.read() if end is None else journal.read(end - start)
    except FileNotFoundError:
        return None
    data = data[:data.rfind(b"\n") + 1]
    return (header, start, data) if data else None


def _segment_paths(objects: Sequence[storage.ObjectInfo]) -> list[str]:
    """The listed journal segments' paths in their file system (as ``load_manifest`` reads)."""
    return [storage.filesystem(o.url)[1] for o in objects if SEGMENT_FILE.fullmatch(o.key)]


def _local_state(manifest: Path) -> tuple:
    """What changes when a manifest is rewritten or its journal grows."""
    state = []
    for path in (manifest, journal_path(manifest)):
        try:
            st = path.stat()
            state.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            state.append(None)
    return tuple(state)


def _local_id(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
