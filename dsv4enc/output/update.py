"""``encode --update``: bring a finished output up to date with its inputs.

Each row keeps an 8-byte stamp of its input, a hash of its key and ``images/headers.file_stamp``:
a single file in its footer (``STAMPS_KEY``: one rename replaces both), a folder in a
``_stamps-HASH.bin`` file its manifest names. An update matches the inputs' stamps against the
old rows' (``Update.match``): an unchanged input takes its old row (``CarriedRows``, read
forward), a new or changed one is encoded, a gone one left out; rows are batch-invariant, so
the result equals a clean run. An old part whose rows all stay, in order and on the run's
segment bounds, is kept (``Update.keep_parts``): a folder's file by reference, a single file's
row groups by bytes.

Crash safety is ``--resume``'s: the update commits to parts of its own (``OUT.partial`` beside a
single file; ``STAGING_NAME`` in a folder, with part names of a new generation) and changes the
old output only at the end: a single file is renamed into place; a folder's new parts are moved
in and its manifest replaced (one rename) before the old parts go."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import OutputError, UsageError
from .parts import (MANIFEST_NAME, PART_FILE, TRANSIENT_ERRORS, PartLedger, PartStore, Row,
                    fsync_dir, manifest_document, read_manifest, temp_path, utf8_text,
                    write_json_atomic)
from ..images.headers import inputs_digest
from .read import embedding_arrays, embedding_format

log = logging.getLogger("dsv4enc")

#: The footer entry of a single-file output that holds its rows' stamps (JSON).
STAMPS_KEY = b"dsv4enc.rows"
#: A folder output's stamps file (the manifest's ``stamps`` entry names the current one).
STAMPS_FILE = re.compile(r"_stamps-[0-9a-f]{16}\.bin")
#: Where a folder output's update commits its parts until the switch (hidden from readers).
STAGING_NAME = ".dsv4enc-update"
_MAGIC = b"DSV4ENC-STAMPS1\n"
#: Settings that decide how parts are cut, not what rows hold: an update or a resumed run
#: may differ there (committed parts are judged by their inputs, wherever they were cut).
CUT_SETTINGS = ("part_images",)
#: The flag that sets each recorded setting whose value is the flag's argument.
FLAG_OF_SETTING = {"compute_dtype": "--dtype", "device": "--device", "out_dtype": "--out-dtype",
                   "features": "--features", "pool": "--pool", "layout": "--layout",
                   "max_pixels": "--max-pixels", "image_column": "--image-column",
                   "key_column": "--key-column"}
#: How a refusal names the recorded settings whose value is no flag's argument.
SHOWN_SETTING = {"keep_columns": "--keep-column", "keep_members": "--keep-member",
                 "weights_fingerprint": "the weights (--weights)",
                 "config": "the model config (--weights/--config)"}


def setting_refusal(refused: str, used: str, key: str, then: Any, now: Any, *,
                    rerun: str = "", again: str) -> str:
    """The one line that refuses a run whose setting ``key`` is ``now`` where the output it
    continues has ``then``: ``refused`` opens it ("cannot resume"), ``used`` names the old
    value's ("the interrupted run used"), ``rerun`` follows the flag that would agree, and
    ``again`` is what --overwrite does instead."""
    flag = FLAG_OF_SETTING.get(key)
    if flag is not None and isinstance(then, (str, int)) and isinstance(now, (str, int)):
        return (f"{refused}: {used} {flag} {then}, this run asks for {now}; rerun with {flag} "
                f"{then}{rerun} (or --overwrite to {again})")
    shown = SHOWN_SETTING.get(key) or flag or key.replace("_", " ")
    return f"{refused}: {shown} differs ({then!r} then, {now!r} now); use --overwrite to {again}"


def _hash8(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def row_stamps(entries: Iterable[tuple[str, str | None]]) -> np.ndarray:
    """One uint64 per row: a hash of its key and its input file's stamp."""
    return np.fromiter((_hash8(utf8_text(key).encode() + b"\0" + (stamp or "").encode())
                        for key, stamp in entries), dtype=np.uint64)


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
    path = folder / f"_stamps-{hashlib.blake2b(data, digest_size=8).hexdigest()}.bin"
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(folder)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return {"file": path.name, "rows": len(stamps), "options": options}


def remove_other_stamps(folder: Path, keep: str | None) -> None:
    for path in folder.iterdir():
        if STAMPS_FILE.fullmatch(path.name) and path.name != keep:
            path.unlink(missing_ok=True)


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


class OldOutput:
    """A finished output as an update sees it: its files in row order, settings and stamps."""

    def __init__(self, out: Path, files: list[Path], settings: dict, stamps: np.ndarray | None,
                 folder: bool, parts: Sequence[tuple[str, int, int]] = ()) -> None:
        self.out, self.files, self.settings, self.stamps = out, files, settings, stamps
        self.folder = folder
        self.parts = list(parts)  # a folder's part files in row order: (name, first row, rows)
        self.listed = {name for name, _, _ in self.parts}  # (the update's names must differ)

    @classmethod
    def find(cls, out: Path, folder_mode: bool) -> "OldOutput | None":
        """The finished output at ``out``, or None when there is none yet (a plain run)."""
        import pyarrow.parquet as pq

        if not folder_mode:
            if not out.is_file():
                return None
            footer = pq.read_metadata(out)  # its key-value entries (the schema shows one)
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
            return cls(out, [out], settings, stamps, False)
        manifest = read_manifest(out / MANIFEST_NAME)
        if manifest is None:
            return None
        parts = sorted(manifest["parts"].values(), key=lambda p: (p["start"], p["file"]))
        sizes = [int(p.get("rows", 0)) for p in parts]
        stamps = _read_folder_stamps(out, manifest.get("stamps"), sum(sizes))
        first = np.cumsum([0] + sizes)
        return cls(out, [out / p["file"] for p in parts], dict(manifest["settings"]), stamps,
                   True, [(p["file"], int(first[i]), sizes[i]) for i, p in enumerate(parts)])

    def check(self, settings: dict) -> None:
        """Refuse in one line a run whose rows would differ, or an output without stamps."""
        if self.stamps is None:
            raise UsageError(
                f"cannot update {self.out}: it does not record its input files per row (made "
                "by an earlier dsv4enc, or an unfinished run: finish it with --resume); rerun "
                "with --overwrite once, then --update works")
        for key, now in settings.items():
            then = self.settings.get(key)
            if key not in CUT_SETTINGS and then != now:
                raise UsageError(setting_refusal(f"cannot update {self.out}", "it was made with",
                                                 key, then, now, again="encode everything again"))

    def column(self, name: str) -> Iterable[Any]:
        """One small column's values, row by row, read a row group at a time."""
        for handle, group in _row_groups(self.files):
            yield from handle.read_row_group(group, columns=[name]).column(0).to_pylist()


def _row_groups(files: Sequence[Path]) -> Iterable[tuple[Any, int]]:
    import pyarrow.parquet as pq

    for path in files:
        handle = pq.ParquetFile(path)
        for group in range(handle.num_row_groups):
            yield handle, group


class CarriedRows:
    """Old rows read forward, one row group at a time (never the whole output)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._groups = _row_groups(files)
        self._start = self._end = 0
        self._rows: list[dict] = []
        self._arrays: list = []

    def row(self, index: int, key: str) -> Row:
        """Old row ``index`` (never below an index asked for before) as a Row for ``key``;
        row groups before it are passed over unread (the parts an update keeps)."""
        while index >= self._end:
            handle, group = next(self._groups)
            self._start = self._end
            self._end += handle.metadata.row_group(group).num_rows
            if index >= self._end:
                continue
            table = handle.read_row_group(group)
            self._arrays = embedding_arrays(table.column("embedding"),
                                            embedding_format(handle.schema_arrow))
            self._rows = table.drop_columns(["embedding"]).to_pylist()
        if index < self._start:
            raise AssertionError("old rows asked for out of order")
        old = self._rows[index - self._start]
        return Row(path=key, width=old["width"], height=old["height"], vit_h=old["vit_h"],
                   vit_w=old["vit_w"], grid_h=old["grid_h"], grid_w=old["grid_w"],
                   embedding=self._arrays[index - self._start], error=old["error"])


class Update:
    """One ``--update`` run over an existing output (see the module's doc)."""

    def __init__(self, old: OldOutput) -> None:
        self.old = old
        self.carried: dict[int, int] = {}  # input index -> old row index
        self.new = self.changed = self.dropped = 0
        self._reader: CarriedRows | None = None
        self.staging: Path | None = None

    @classmethod
    def start(cls, out: Path, folder_mode: bool) -> "Update | None":
        """The update of ``out``, or None when there is no finished output there yet."""
        old = OldOutput.find(out, folder_mode)
        return cls(old) if old is not None else None

    def open_store(self, settings: dict, rows_settings: dict) -> PartStore | None:
        """A folder output's staging store (None for a single file: its own store serves).
        A staging folder of other settings, or whose part names a switch took, goes."""
        if not self.old.folder:
            return None
        self.staging = self.old.out / STAGING_NAME
        recorded = read_manifest(self.staging / MANIFEST_NAME)
        if recorded is None or recorded["settings"] != rows_settings or self.old.listed & {
                p.get("file") for p in recorded["parts"].values() if not p.get("kept")}:
            shutil.rmtree(self.staging, ignore_errors=True)
        store = PartStore(self.staging, settings)
        generations = [int(m.group(1) or 0) for name in self.old.listed
                       if (m := re.search(r"(?:\.g(\d+))?\.parquet$", name))]
        store.file_suffix = f".g{max(generations, default=0) + 1}"
        return store

    def match(self, planned: Sequence, settings: dict) -> None:
        """Check the settings, then decide which inputs take their old row: same key and
        file stamp, readable now, an old row without a transient error, in input order (a
        reordered input list re-encodes what would need a backward read)."""
        if not settings.get("batch_invariant", True):
            raise UsageError("--update copies rows beside new ones, which equals a clean run "
                             "only with batch-invariant rows: drop --no-deterministic "
                             "(and --tp-mode weights)")
        self.old.check(settings)
        old = self.old.stamps
        transient = np.fromiter((error is not None and error.startswith(TRANSIENT_ERRORS)
                                 for error in self.old.column("error")), dtype=bool,
                                count=len(old))
        now = row_stamps((p.item.key, p.stamp) for p in planned)
        order = np.argsort(old, kind="stable")
        ranked = old[order]
        where = np.minimum(np.searchsorted(ranked, now), max(len(old) - 1, 0))
        found = (ranked[where] == now) if len(old) else np.zeros(len(now), dtype=bool)
        last = -1
        for j in np.flatnonzero(found):
            i = int(order[where[j]])
            if planned[j].error is None and not transient[i] and i > last:
                self.carried[int(j)] = i
                last = i
        keys_now = np.fromiter((_hash8(utf8_text(p.item.key).encode()) for p in planned),
                               dtype=np.uint64, count=len(planned))
        keys_old = np.fromiter((_hash8(path.encode()) for path in self.old.column("path")),
                               dtype=np.uint64, count=len(old))
        self.new = int((~np.isin(keys_now, keys_old)).sum())
        self.changed = len(planned) - len(self.carried) - self.new
        self.dropped = int((~np.isin(keys_old, keys_now)).sum())
        log.info("update of %s: %d rows kept, %d new inputs, %d changed, %d gone",
                 self.old.out, len(self.carried), self.new, self.changed, self.dropped)
        self._reader = CarriedRows(self.old.files)

    def rows(self, indices: Sequence[int], planned: Sequence) -> dict[int, Row]:
        """The carried rows among ``indices`` (ascending), copied from the old output."""
        return {index: self._reader.row(self.carried[index], planned[index].item.key)
                for index in indices if index in self.carried}

    def keep_parts(self, store: PartLedger, todo: Sequence, planned: Sequence) -> tuple[list, int]:
        """Old parts whose rows this run takes unchanged, in order and on its segment bounds,
        are kept (a folder's file by reference, a single file's row groups copied by bytes),
        their segments dropped from ``todo``. Returns the segments left and the rows kept."""
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
        for unit, first, rows in units:
            start = new_of.get(first, -1)  # -1: its first row is not carried
            end = start + rows
            if (rows == 0 or start not in at_start or end not in at_end
                    or not (single or (self.old.out / unit).is_file())):
                continue  # its rows moved off this run's segment bounds (or it is gone)
            i, j = at_start[start], at_end[end]
            if any(todo[k].end != todo[k + 1].start for k in range(i, j)) or not all(
                    self.carried.get(start + k) == first + k for k in range(rows)):
                continue  # not one run of segments, or not these rows in this order
            entry = {"start": start, "end": end, "digest": inputs_digest(planned[start:end]),
                     "rows": rows, "transient": 0}
            if single:
                store.copy_groups(todo[i].name, self.old.out, unit, entry)
            else:
                store.adopt(todo[i].name, {"file": unit, **entry, "kept": True})
            dropped.update(range(i, j + 1))
            kept += rows
        return [p for k, p in enumerate(todo) if k not in dropped], kept

    def finish_folder(self, store: PartStore, stamps: np.ndarray, options: dict) -> None:
        """Switch a folder output to the staged parts (in the order the module's doc says)."""
        out = self.old.out
        entry = _write_stamps(out, stamps, options)
        parts = {name: {k: v for k, v in part.items() if k != "kept"}
                 for name, part in store.parts.items()}
        for part in store.parts.values():
            if not part.get("kept"):  # a kept part is in place already
                os.replace(store.folder / part["file"], out / part["file"])
        fsync_dir(out)
        write_json_atomic(manifest_document(store.settings, parts, stamps=entry),
                          out / MANIFEST_NAME)  # the switch
        for old in self.old.listed - {part["file"] for part in parts.values()}:
            if PART_FILE.fullmatch(old):
                (out / old).unlink(missing_ok=True)
        remove_other_stamps(out, keep=entry["file"])
        shutil.rmtree(store.folder, ignore_errors=True)

    def count_into(self, summary) -> None:
        summary.update = True
        summary.dropped = self.dropped
