"""``encode --update``: bring a finished output up to date with its inputs
(docs/resume-and-safety.md tells what it guarantees and where it builds the new output).

Each row keeps an 8-byte stamp of its input, a hash of its key and ``storage.stamp``. An
update matches the inputs' stamps against the old rows' (``Update.match``): an unchanged
input takes its old row (``CarriedRows``, read forward), a new or changed one is encoded, a
gone one left out; rows are batch-invariant, so the result equals a clean run. An old part
whose rows all stay, in order and on the run's segment bounds, is kept
(``Update.keep_parts``). A folder's new output is exchanged with the old one at the end in
one atomic step (``switch``)."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .. import storage
from ..columns import utf8_text
from ..errors import AlreadyComplete, UsageError, output_os_error
from ..pausepoints import pause
from .files import (LOCK_NAME, MANIFEST_NAME, STAMPS_FILE, generation, is_ours, old_folder,
                    stamps_name, staging_folder, temp_path)
from .parts import (PartStore, Row, fsync_dir, manifest_document,
                    part_kept, read_manifest, store_failure, write_atomic, write_json_atomic)
from ..images.decode import is_transient
from ..images.headers import Planned, inputs_digest
from ..images.items import InputItem
from .read import check_column_chunks, check_parts, embedding_arrays, embedding_format

log = logging.getLogger("dsv4enc")

#: The footer entry of a single-file output that holds its rows' stamps (JSON).
STAMPS_KEY = b"dsv4enc.rows"
#: The manifest entry of an update's staging folder: the stamps file of the output it updates
#: (a staging folder of another output's state, or an old output a switch left, is not reused).
#: A folder an update made keeps it: an update stopped at its switch is switched by the next,
#: and the old output that a switch stopped midway left there is known as that output's.
UPDATE_OF = "update_of"
_MAGIC = b"DSV4ENC-STAMPS1\n"
#: How many of the dropped rows' paths a refusal and the summary show.
DROPPED_SHOWN = 3
#: Settings that decide how parts are cut, not what rows hold: an update or a resumed run
#: may differ there (committed parts are judged by their inputs, wherever they were cut).
CUT_SETTINGS = ("part_images",)
#: Settings an output of an earlier dsv4enc may not have recorded: compared where recorded.
LATER_SETTINGS = ("fused",)
#: The flag that sets each recorded setting whose value is the flag's argument.
FLAG_OF_SETTING = {"compute_dtype": "--dtype", "device": "--device", "out_dtype": "--out-dtype",
                   "features": "--features", "pool": "--pool", "layout": "--layout",
                   "max_pixels": "--max-pixels", "image_column": "--image-column",
                   "key_column": "--key-column"}
#: How a refusal names the recorded settings whose value is no flag's argument.
SHOWN_SETTING = {"keep_columns": "--keep-column", "keep_members": "--keep-member",
                 "weights_fingerprint": "the weights (--weights)",
                 "fused": "fused kernels (--fused; rows equal the eager tower's to rounding)",
                 "config": "the model config (--weights/--config)",
                 "batch_invariant": "batch invariance (--deterministic; off under --tp-mode "
                                    "weights)"}


def check_settings(recorded: dict, settings: dict, refused: str, used: str, *,
                   rerun: str = "", again: str, given: str) -> None:
    """Refuse in one line (a UsageError) a run whose ``settings`` differ from those the output
    it continues ``recorded``, but where parts are cut: ``refused`` opens the line ("cannot
    resume"), ``used`` names the old value's ("the interrupted run used"), ``rerun`` follows
    the flag that would agree, and ``again`` is what --overwrite does instead of ``given``
    (the run's flag, which --overwrite contradicts)."""
    key = next((key for key, now in settings.items()
                if key not in CUT_SETTINGS and recorded.get(key) != now
                and (key in recorded or key not in LATER_SETTINGS)), None)
    if key is None:
        return
    then, now = recorded.get(key), settings[key]
    flag = FLAG_OF_SETTING.get(key)
    instead = f"--overwrite in place of {given} to {again}"
    if flag is not None and isinstance(then, (str, int)) and isinstance(now, (str, int)):
        raise UsageError(f"{refused}: {used} {flag} {then}, this run asks for {now}; rerun "
                         f"with {flag} {then}{rerun} (or {instead})")
    shown = SHOWN_SETTING.get(key) or flag or key.replace("_", " ")
    raise UsageError(f"{refused}: {shown} differs ({then!r} then, {now!r} now); use {instead}")


def _hash8(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


#: A damaged part's rows in ``OldOutput.column``, where a value may be None.
_MISSING: Any = object()
#: What an old row is to the matching (``Update.match``): an embedding, an error row that the
#: same file gives again, one whose read may succeed now, and a row of a damaged part.
_ROW, _FAILED, _RETRY, _UNREADABLE = range(4)


def _row_kind(error: str | None, retry_errors: bool) -> int:
    if error is None:
        return _ROW
    if error is _MISSING:
        return _UNREADABLE
    return _RETRY if retry_errors or is_transient(error) else _FAILED


def row_stamps(entries: Iterable[tuple[str, str | None]]) -> np.ndarray:
    """One uint64 per row: a hash of its key and its input file's stamp."""
    return np.fromiter((_hash8(utf8_text(key).encode() + b"\0" + (stamp or "").encode())
                        for key, stamp in entries), dtype=np.uint64)


def keyed_stamps(keys: Iterable[str], inputs: Sequence[Planned]) -> np.ndarray:
    """The stamps of rows given by their keys (raw, or as the ``path`` column's text), each
    that of one of ``inputs`` (stamped): a part's rows in its file's order."""
    stamps = {utf8_text(p.item.key): p.stamp for p in inputs}
    return row_stamps((key, stamps[utf8_text(key)]) for key in keys)


def footer_entry(stamps: np.ndarray, options: dict) -> dict[bytes, bytes]:
    """A single file's footer entry: its rows' stamps (base64 of little-endian uint64) and
    the row options the schema's metadata does not hold."""
    data = stamps.astype("<u8").tobytes()
    return {STAMPS_KEY: json.dumps({"version": 1, "rows": len(stamps), "options": options,
                                    "stamps": base64.b64encode(data).decode("ascii")},
                                   sort_keys=True).encode()}


def write_folder_stamps(folder: Path, store, stamps: np.ndarray, options: dict) -> None:
    """At the end of a folder output's run: its stamps file, then the manifest naming it,
    then any older stamps file."""
    entry = _write_stamps(folder, stamps, options)
    store.extra = {**store.extra, "stamps": entry}
    store.save()
    remove_other_stamps(folder, keep=entry["file"])


def _write_stamps(folder: Path, stamps: np.ndarray, options: dict) -> dict[str, Any]:
    """A folder output's stamps file, named by its content; returns the manifest's entry."""
    data = _MAGIC + stamps.astype("<u8").tobytes()
    path = folder / stamps_name(data)
    write_atomic(path, data)
    return {"file": path.name, "rows": len(stamps), "options": options}


def remove_other_stamps(folder: Path, keep: str | None) -> None:
    for path in folder.iterdir():
        if STAMPS_FILE.fullmatch(path.name) and path.name != keep:
            path.unlink(missing_ok=True)


def is_stamps_file(path: Path) -> bool:
    """Whether the file at ``path`` starts as a stamps file does (``_write_stamps``): how a
    file under a stamps name is known to be dsv4enc's."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def _read_folder_stamps(folder: Path, entry: Any, rows: int) -> np.ndarray | None:
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
            and STAMPS_FILE.fullmatch(entry["file"]) and entry.get("rows") == rows):
        return None
    try:
        data = (folder / entry["file"]).read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC) or len(data) != len(_MAGIC) + 8 * rows:
        return None
    return np.frombuffer(data, dtype="<u8", offset=len(_MAGIC)).astype(np.uint64)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def exchange(a: Path, b: Path) -> bool:
    """Exchange two folders in one atomic step (Linux's ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # not glibc 2.28+ (musl, macOS, Windows)
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def switch(new: Path, out: Path) -> Path:
    """Put the complete folder ``new`` at ``out``; returns where the old output is now. One
    atomic exchange where the system has it: every reader sees the old output or the new.
    Else two renames, the old output first moved aside (``old_folder``): a reader between
    them finds no output, never a mix of both, and ``recover_switch`` undoes a stop there."""
    if exchange(new, out):
        fsync_dir(out.parent)
        return new
    aside = old_folder(out)
    os.rename(out, aside)
    os.rename(new, out)
    fsync_dir(out.parent)
    return aside


def recover_switch(out: Path) -> None:
    """Before an update of ``out``: a switch stopped between its two renames left no output
    there; the old one goes back (the update then switches again)."""
    aside = old_folder(out)
    if not os.path.lexists(out) and aside.is_dir():
        os.rename(aside, out)


def remove_old_output(folder: Path, out: Path) -> None:
    """Remove a folder an update left (an old output, or a staging folder not reused): its
    dsv4enc files; anything else in it (a hidden file of the user's) is moved to ``out``."""
    for path in folder.iterdir():
        if not is_ours(path.name):
            if not os.path.lexists(out / path.name):
                os.rename(path, out / path.name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    with contextlib.suppress(OSError):  # something of the user's could not be moved: kept
        folder.rmdir()


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (a copy where the file system has none)."""
    tmp = temp_path(target)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copy2(source, tmp)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_os_error(target, exc) from None


class OldOutput:
    """A finished output as an update sees it: its parts in row order, settings and stamps.
    A folder's part file that is gone, cut short or damaged (``parts.part_kept``) is
    ``damaged``: its rows are never carried, so the update encodes their inputs again (a
    repair). ``stored``: the part objects of a bucket folder, read where they are (``remote.RemoteOutput.stored``).
    ``blocks``: the first row of each run of parts that share an input range (a
    ``--shard-output`` folder's ranks' files of one part, whose rows interleave in input
    order), else None."""

    def __init__(self, out: Path, units: Sequence[tuple[str, int, int]], settings: dict,
                 stamps: np.ndarray | None, folder: bool, damaged: Iterable[str] = (),
                 stored: Mapping[str, storage.ObjectInfo] | None = None,
                 blocks: np.ndarray | None = None) -> None:
        self.out, self.settings, self.stamps, self.folder = out, settings, stamps, folder
        self.blocks, self.stored = blocks, stored or {}
        self.parts = list(units)  # its files in row order: (name, first row, rows)
        self.damaged = set(damaged)  # the names of those whose rows cannot be read
        self.listed = {name for name, _, _ in self.parts}  # (the update's names must differ)
        self.stamps_file: str | None = None  # a folder's: names its state (``UPDATE_OF``)
        self.made_from: str | None = None  # the stamps file of the output it updated, if any

    @property
    def files(self) -> list[tuple[Path | None, int]]:
        """Each part's file (None: damaged) and rows, in row order."""
        return [(None if name in self.damaged else self.where(name), rows)
                for name, _, rows in self.parts]

    def where(self, name: str) -> str | Path:
        """Where part file ``name`` is read: its object in the bucket, or its local file (a
        single file's only part: the file)."""
        if name in self.stored:
            return self.stored[name].url
        return self.out / name if self.folder else self.out

    @property
    def damaged_rows(self) -> int:
        return sum(rows for name, _, rows in self.parts if name in self.damaged)

    @classmethod
    def find(cls, out: Path, folder_mode: bool,
             stored: Mapping[str, storage.ObjectInfo] | None = None) -> "OldOutput | None":
        """The finished output at ``out``, or None when there is none yet (a plain run)."""
        import pyarrow.parquet as pq

        if not folder_mode:
            if not out.is_file():
                return None
            # A bucket's file is read where it is (its local stand-in holds no row)
            where = stored[out.name].url if stored and out.name in stored else out
            with storage.open_input(str(where)) as handle:
                footer = pq.read_metadata(handle)  # its key-value entries (the schema shows one)
            try:  # its rows are read (carried) by their column chunks' metadata
                check_column_chunks(footer)
            except ValueError as exc:  # an update has no other copy of its rows to repair it
                raise UsageError(f"cannot update {out}: not a readable Parquet file ({exc}): "
                                 "encode it again (--overwrite in place of --update)") from None
            metadata = footer.metadata or {}
            settings = json.loads(metadata.get(b"dsv4enc", b"{}"))
            settings.pop("embedding", None)
            stamps = None
            try:
                entry = json.loads(metadata[STAMPS_KEY])
                settings.update(entry.get("options") or {})
                data = base64.b64decode(entry["stamps"])
                if len(data) == 8 * footer.num_rows:
                    stamps = np.frombuffer(data, dtype="<u8").astype(np.uint64)
            except (KeyError, ValueError, TypeError):
                pass
            return cls(out, [(out.name, 0, footer.num_rows)], settings, stamps, False,
                       stored=stored)
        manifest = read_manifest(out / MANIFEST_NAME)
        if manifest is None:
            return None
        check_parts(manifest, str(out / MANIFEST_NAME))
        parts = sorted(manifest["parts"].values(), key=lambda p: (p["start"], p["file"]))
        sizes = [int(p.get("rows", 0)) for p in parts]
        stamps = _read_folder_stamps(out, manifest.get("stamps"), sum(sizes))
        first = np.cumsum([0] + sizes)
        damaged = [p["file"] for p in parts if not part_kept(p, out, stored or {})]
        blocks = [int(first[i]) for i, p in enumerate(parts)
                  if i == 0 or p["start"] >= parts[i - 1]["end"]]
        found = cls(out, [(p["file"], int(first[i]), sizes[i]) for i, p in enumerate(parts)],
                    dict(manifest["settings"]), stamps, True, damaged, stored,
                    np.array(blocks) if len(blocks) < len(parts) else None)
        if stamps is not None:
            found.stamps_file = manifest["stamps"]["file"]
        if isinstance(manifest.get(UPDATE_OF), str):
            found.made_from = manifest[UPDATE_OF]
        return found

    def check(self, settings: dict) -> None:
        """Refuse in one line a run whose rows would differ, or an output without stamps."""
        if self.stamps is None and self.stored and "world_size" in self.settings:
            raise UsageError(
                f"cannot update {self.out}: a --shard-output folder in object storage does not "
                "record its input files per row; rerun once with --overwrite in place of "
                "--update and without --shard-output (or to a local --out), then --update works")
        if self.stamps is None:
            raise UsageError(
                f"cannot update {self.out}: it does not record its input files per row (made "
                "by an earlier dsv4enc, or an unfinished run: finish it with --resume); rerun "
                "once with --overwrite in place of --update, then --update works")
        check_settings(self.settings, settings, f"cannot update {self.out}", "it was made with",
                       again="encode everything again", given="--update")
        if self.damaged:
            shown = ", ".join(sorted(self.damaged)[:3])
            log.warning("%s: %d part file%s missing, cut short or damaged (%s); the update "
                        "encodes %s %d rows again", self.out, len(self.damaged),
                        "s are" if len(self.damaged) > 1 else " is", shown,
                        "their" if len(self.damaged) > 1 else "its", self.damaged_rows)

    def block_of(self, rows: np.ndarray) -> np.ndarray:
        """The block of each of ``rows``: carried rows are read a block at a time, in any order
        within one (``CarriedRows``); without ``blocks``, each row is its own."""
        return rows if self.blocks is None else np.searchsorted(self.blocks, rows, "right")

    def column(self, name: str, missing: Any = None) -> Iterable[Any]:
        """One small column's values, row by row, read a row group at a time (``missing``
        for each row of a damaged part)."""
        for path, handle, group, rows in _row_groups(self.files):
            if handle is None:
                yield from [missing] * rows
            else:
                yield from _stored(path, lambda: handle.read_row_group(
                    group, columns=[name])).column(0).to_pylist()


def _row_groups(files: Sequence[tuple[str | Path | None, int]]
                ) -> Iterable[tuple[Any, Any, int, int]]:
    """(path, file handle, row group, rows) in row order; a damaged part's rows as one
    (None, None, 0, rows). An object is read in ranges: only the columns asked for travel."""
    import pyarrow.parquet as pq

    for path, rows in files:
        if path is None:
            yield None, None, 0, rows
            continue
        try:  # the open is retried by ``open_input``: not again here
            handle = pq.ParquetFile(storage.open_input(str(path)))
        except OSError as exc:
            if not storage.reads_are_requests(str(path)):
                raise
            raise store_failure(str(path), exc) from None
        for group in range(handle.num_row_groups):
            yield path, handle, group, handle.metadata.row_group(group).num_rows


def _stored(path: str | Path, read: Callable[[], Any]) -> Any:
    """``read()`` of the old part ``path``; of an object, retried as any call to its store,
    and a failure is the run's one line about the store (``store_failure``), not pyarrow's
    ``OSError`` (a traceback)."""
    if not storage.reads_are_requests(str(path)):
        return read()
    try:
        return storage.retrying(read, store=storage.store_of(str(path)))
    except OSError as exc:
        raise store_failure(str(path), exc) from None


class CarriedRows:
    """Old rows read forward, one row group, or one of ``OldOutput.blocks``, at a time (never
    the whole output)."""

    def __init__(self, files: Sequence[tuple[str | Path | None, int]],
                 blocks: np.ndarray | None = None) -> None:
        self._groups = _row_groups(files)
        self._ends = deque([] if blocks is None else
                           [*blocks[1:].tolist(), sum(rows for _, rows in files)])
        self._start = self._end = 0
        self._rows: list[dict | None] = []
        self._arrays: list = []

    def row(self, index: int, key: str) -> Row:
        """Old row ``index`` (never in a block before one asked for before, never in a damaged
        part) as a Row for ``key``; blocks before it are passed over unread (kept parts)."""
        while index >= self._end:
            self._next_block(index)
        if index < self._start:
            raise AssertionError("old rows asked for out of order")
        old = self._rows[index - self._start]
        if old is None:
            raise AssertionError("a row of a damaged part asked for")
        return Row(path=key, width=old["width"], height=old["height"], vit_h=old["vit_h"],
                   vit_w=old["vit_w"], grid_h=old["grid_h"], grid_w=old["grid_w"],
                   embedding=self._arrays[index - self._start], error=old["error"])

    def _next_block(self, index: int) -> None:
        """Read the next block's row groups (passed over when ``index`` lies beyond it)."""
        self._start, self._rows, self._arrays = self._end, [], []
        while self._ends and self._ends[0] <= self._start:
            self._ends.popleft()
        while True:
            path, handle, group, rows = next(self._groups)
            self._end += rows
            end = self._ends[0] if self._ends else self._end
            if index < end and handle is None:
                self._rows += [None] * rows
                self._arrays += [None] * rows
            elif index < end:
                table = _stored(path, lambda: handle.read_row_group(group))
                self._arrays += list(embedding_arrays(table.column("embedding"),
                                                      embedding_format(handle.schema_arrow)))
                self._rows += table.drop_columns(["embedding"]).to_pylist()
            if self._end >= end:
                return


class Update:
    """One ``--update`` run over an existing output (see the module's doc)."""

    def __init__(self, old: OldOutput) -> None:
        self.old = old
        self.carried: dict[int, int] = {}  # input index -> old row index
        self.new = self.changed = self.dropped = self.carried_failed = self.rows_before = 0
        self.dropped_paths: list[str] = []  # the first DROPPED_SHOWN of them
        self.unlisted: dict[int, int] = {}  # --keep-unlisted: input index -> old row kept as is
        self._reader: CarriedRows | None = None
        self.staging: Path | None = None

    @classmethod
    def start(cls, out: Path, folder_mode: bool,
              stored: Mapping[str, storage.ObjectInfo] | None = None) -> "Update | None":
        """The update of ``out`` (``stored``: as ``OldOutput`` takes it), or None when there
        is no finished output there yet."""
        old = OldOutput.find(out, folder_mode, stored)
        return cls(old) if old is not None else None

    def open_store(self, settings: dict, rows_settings: dict) -> PartStore | None:
        """A folder output's staging store (None for a single file: its own store serves),
        reused when an interrupted update of this same output state left it; what an earlier
        switch or update left beside the output goes."""
        if not self.old.folder:
            return None
        out = self.old.out
        self.staging = staging_folder(out)
        try:
            if os.path.isdir(old_folder(out)):
                remove_old_output(old_folder(out), out)
            recorded = read_manifest(self.staging / MANIFEST_NAME)
            if os.path.isdir(self.staging) and (
                    recorded is None or recorded["settings"] != rows_settings
                    or recorded.get(UPDATE_OF) != self.old.stamps_file
                    or "stamps" in recorded and self._made_it(recorded["stamps"])):
                remove_old_output(self.staging, out)
            elif recorded is not None and "stamps" in recorded:
                self._reopen(recorded)
        except OSError as exc:
            raise output_os_error(self.staging, exc) from None
        store = PartStore(self.staging, settings)
        store.extra[UPDATE_OF] = self.old.stamps_file
        store.generation = max(map(generation, self.old.listed), default=0) + 1
        return store

    def _made_it(self, stamps: Any) -> bool:
        """Whether a complete output of these ``stamps`` (its manifest's entry) is the one
        this output was made from: the old output that a switch stopped before its removal
        left in the staging folder, never to be switched in again."""
        return not isinstance(stamps, dict) or stamps.get("file") == self.old.made_from

    def _reopen(self, recorded: dict) -> None:
        """The staging folder holds the complete new output of an update of this output
        that stopped at its switch: its manifest no longer names its stamps, so that the run
        takes its parts as committed ones (``resume.Resume``, by their inputs) and switches
        it in place, encoding only what changed since."""
        recorded = {key: value for key, value in recorded.items() if key != "stamps"}
        write_json_atomic(recorded, self.staging / MANIFEST_NAME)

    def with_unlisted(self, planned: Sequence[Planned]) -> list[Planned]:
        """``--keep-unlisted``: the old rows in their order, each in the place of the input
        given with its key (``planned``), or else kept as it is (``unlisted``: never read,
        stamped or encoded); the inputs given that no old row has follow, in their order."""
        if self.old.damaged:
            raise UsageError(f"--keep-unlisted cannot keep the rows of {self.old.out}'s "
                             "damaged parts: rerun the original inputs with --update to "
                             "repair it first")
        given = {utf8_text(p.item.key): p for p in planned}
        merged: list[Planned] = []
        for row, key in enumerate(self.old.column("path")):
            entry = given.pop(key, None)
            if entry is None:
                self.unlisted[len(merged)] = row
                entry = Planned(InputItem(key=key, path=key), stamp=f"kept {row}")
            merged.append(entry)
        return merged + list(given.values())

    def restamp(self, stamps: np.ndarray) -> None:
        """The kept rows' stamps (``with_unlisted``) are their old ones: a later update
        matches them against their files as before."""
        if self.unlisted:
            now, old = zip(*self.unlisted.items())
            stamps[list(now)] = self.old.stamps[list(old)]

    def match(self, planned: Sequence, settings: dict, retry_errors: bool = False) -> None:
        """Check the settings, then decide which inputs take their old row: same key and
        file stamp (the file is not read), in input order (a reordered input list re-encodes
        what would need a backward read), and an old row that is an embedding, or a
        permanent error (``images/decode.is_transient``; ``retry_errors``: no error row)."""
        if not settings.get("batch_invariant", True):
            raise UsageError("--update copies rows beside new ones, which equals a clean run "
                             "only with batch-invariant rows: drop --no-deterministic "
                             "(and --tp-mode weights)")
        self.old.check(settings)
        self._pair(planned, retry_errors)
        log.info("update of %s: %d rows kept, %d new inputs, %d changed, %d gone",
                 self.old.out, len(self.carried), self.new, self.changed, self.dropped)
        self._reader = CarriedRows(self.old.files, self.old.blocks)

    def check_finished(self, planned: Sequence, settings: dict) -> None:
        """``--resume`` of this finished single file, whose parts are gone: AlreadyComplete
        where a clean run would give its rows (the same settings, each input's stamp and key
        in the same order, no row whose read may pass now), else a refusal in one line that
        counts what changed (``--update`` encodes only that)."""
        out = self.old.out
        check_settings(self.old.settings, settings, f"cannot resume {out}", "it was made with",
                       again="encode everything again", given="--resume")
        if self.old.stamps is not None:
            self._pair(planned, retry_errors=False)
            if not self.unchanged:
                again = len(planned) - len(self.carried)
                raise UsageError(
                    f"cannot resume {out}: it is complete, but its inputs changed since "
                    f"({again:,} to encode: new, changed or failed for a reason that may pass "
                    f"now; {self.dropped:,} of its rows no longer given); pass --update in "
                    "place of --resume to bring it up to date (--dry-run shows the counts), or "
                    "--overwrite to encode everything again")
        raise AlreadyComplete(f"{out} is already complete; nothing to resume "
                              "(pass --overwrite to encode again)")

    def _pair(self, planned: Sequence, retry_errors: bool) -> None:
        """Which inputs take which old row (``carried``), and the counts of the rest."""
        old = self.old.stamps
        kinds = np.fromiter((_row_kind(error, retry_errors)
                             for error in self.old.column("error", _MISSING)),
                            dtype=np.int8, count=len(old))
        now = row_stamps((p.item.key, p.stamp) for p in planned)
        order = np.argsort(old, kind="stable")
        ranked = old[order]
        where = np.minimum(np.searchsorted(ranked, now), max(len(old) - 1, 0))
        found = (ranked[where] == now) if len(old) else np.zeros(len(now), dtype=bool)
        matched = np.flatnonzero(found)
        rows = order[where[matched]]
        last = -1
        for j, i, block in zip(matched.tolist(), rows.tolist(), self.old.block_of(rows).tolist()):
            kind = kinds[i]
            if block >= last and (kind == _FAILED or kind == _ROW and planned[j].error is None):
                self.carried[j] = i
                last = block
        self.carried.update(self.unlisted)
        self.carried = dict(sorted(self.carried.items()))
        self.carried_failed = int(sum(kinds[i] != _ROW for i in self.carried.values()))
        keys_now = np.fromiter((_hash8(utf8_text(p.item.key).encode()) for p in planned),
                               dtype=np.uint64, count=len(planned))
        keys_old = np.fromiter((_hash8(path.encode()) if path is not None else 0  # damaged
                                for path in self.old.column("path")), dtype=np.uint64,
                               count=len(old))
        known = kinds != _UNREADABLE  # a damaged part's keys are not known: not dropped
        self.new = int((~np.isin(keys_now, keys_old[known])).sum())
        self.changed = len(planned) - len(self.carried) - self.new
        gone = known & ~np.isin(keys_old, keys_now)
        self.dropped = int(gone.sum())
        self.rows_before = len(old)
        if self.dropped:  # a second read of the path column, only when rows go
            first = set(np.flatnonzero(gone)[:DROPPED_SHOWN].tolist())
            self.dropped_paths = [path for i, path in enumerate(self.old.column("path"))
                                  if i in first]

    @property
    def unchanged(self) -> bool:
        """Whether the output as it is equals a clean run: each old row carried, in place."""
        return not (self.new or self.changed or self.dropped) and (
            len(self.carried) == self.rows_before)

    def check_drop(self, share: float, one_by_one: bool) -> None:
        """Refuse in one line an update that drops more than ``share`` of the output's rows,
        or any row when the inputs were given one file at a time (``one_by_one``): an input
        list given in part would drop the rest (``--prune`` allows it: not called)."""
        if not self.dropped or not one_by_one and self.dropped <= share * self.rows_before:
            return
        share = "" if one_by_one else f"more than {share:.0%}: "
        given = "files" if one_by_one else "inputs"
        raise UsageError(f"--update would drop {self.dropped:,} of the {self.rows_before:,} "
                         f"rows of {self.old.out} ({share}their images are not among the "
                         f"{given} given, e.g. {', '.join(self.dropped_paths)}); pass --prune "
                         "to drop them, --keep-unlisted to keep them and encode only the "
                         "inputs given, or give every input (--dry-run shows the counts)")

    def rows(self, indices: Sequence[int], planned: Sequence) -> dict[int, Row]:
        """The carried rows among ``indices`` (ascending), copied from the old output."""
        return {index: self._reader.row(self.carried[index], planned[index].item.key)
                for index in indices if index in self.carried}

    def keep_parts(self, store: PartStore, todo: Sequence, planned: Sequence) -> tuple[list, int]:
        """Old parts whose rows this run takes unchanged and in order, alone or run together
        (the pieces of one part that a commit by time cut), from one of this run's part
        bounds to another, are kept (a folder's file linked as it is, a single file's row
        groups copied by bytes), their parts dropped from ``todo``. Returns the parts left
        and the rows kept."""
        from .appending import AppendingStore

        single = not self.old.folder and isinstance(store, AppendingStore)
        if not todo or not (single or self.staging is not None):
            return list(todo), 0
        units = self.old.parts
        if single:  # another footer (pyarrow, --part-images): no parts, its rows are carried
            parts = store.file_parts(self.old.out, STAMPS_KEY)
            first = np.cumsum([0] + [rows for _, rows in parts])
            units = [(groups, int(first[k]), rows) for k, (groups, rows) in enumerate(parts)]
        new_of = {old: new for new, old in self.carried.items()}
        at_start = {p.start: i for i, p in enumerate(todo)}
        at_end = {p.end: i for i, p in enumerate(todo)}
        dropped, kept = set(), 0
        run: list[tuple[Any, int, int]] = []  # the units taken so far: (unit, start, end)
        for unit, first, rows in units:
            start = new_of.get(first, -1)  # -1: its first row is not carried
            if not (rows and self._takes_whole(first, start, rows)
                    and (single or unit in self.old.stored or (self.old.out / unit).is_file())):
                run = []  # some of its rows are not taken as they are (or it is gone)
                continue
            if run and run[-1][2] != start:
                run = []  # new inputs come between it and the run before
            if run or start in at_start:
                run.append((unit, start, start + rows))
            if run and start + rows in at_end:
                i, j = at_start[run[0][1]], at_end[start + rows]
                if all(todo[k].end == todo[k + 1].start for k in range(i, j)):
                    kept += self._keep(store, todo[i], run, planned, single)
                    dropped.update(range(i, j + 1))
                run = []
        return [p for k, p in enumerate(todo) if k not in dropped], kept

    def _takes_whole(self, first: int, start: int, rows: int) -> bool:
        """Whether this run takes old rows ``first..first+rows`` as its ``start..``, in order."""
        return start >= 0 and all(self.carried.get(start + k) == first + k for k in range(rows))

    def _keep(self, store: PartStore, part, run: list, planned: Sequence, single: bool) -> int:
        """Keep the old units of ``run``, which begins where this run's ``part`` does (each
        under the name of the range it starts); returns their rows."""
        for unit, start, end in run:
            name = part.name if start == part.start else part.rest(start).name
            entry = {"start": start, "end": end, "digest": inputs_digest(planned[start:end]),
                     "rows": end - start, "transient": 0}
            if single:
                store.copy_groups(name, self.old.out, unit, entry)
            else:  # linked into the staging folder (an object stays): the new output holds it
                if unit not in self.old.stored:
                    link_or_copy(self.old.out / unit, store.folder / unit)
                else:  # an object is judged whole by its size (``parts.part_kept``)
                    entry["size"] = self.old.stored[unit].size
                store.adopt(name, {"file": unit, **entry})
        return run[-1][2] - run[0][1]

    def finish_folder(self, store: PartStore, stamps: np.ndarray, options: dict,
                      switched: Callable[[], None] = lambda: None) -> None:
        """Complete the staging folder (its stamps, its manifest written whole, the output's
        lock linked in), switch it with the output, then remove the old output. ``switched()``
        is called once the new output is in place: the update is done, and a stop that came
        then would leave the old output in the staging folder and a line asking to finish."""
        out, staging = self.old.out, store.folder
        entry = _write_stamps(staging, stamps, options)
        extra = {k: v for k, v in store.extra.items() if k != "stamps"}  # (``UPDATE_OF`` stays)
        write_json_atomic(manifest_document(store.settings, store.parts, stamps=entry, **extra),
                          staging / MANIFEST_NAME)
        try:
            store.journal_path.unlink(missing_ok=True)
            remove_other_stamps(staging, keep=entry["file"])
            with contextlib.suppress(OSError):  # the same lock, held: no run starts meanwhile
                os.link(out / LOCK_NAME, staging / LOCK_NAME)
            fsync_dir(staging)
            pause("switch", out=str(out))
            old = switch(staging, out)
            switched()
            pause("switched", out=str(out))
            remove_old_output(old, out)
        except OSError as exc:
            raise output_os_error(out, exc) from None

    def count_into(self, summary) -> None:
        """The update's own counts (``run/summary.RunSummary``): rows dropped, the first of
        their paths, and the error rows carried (reused, not failed again)."""
        summary.update = True
        summary.dropped, summary.dropped_paths = self.dropped, list(self.dropped_paths)
        summary.reused_failed = self.carried_failed
