"""Reading dsv4enc output back: ``read_embeddings`` streams rows as numpy arrays.

Works on a single Parquet file and on a dataset folder of part files (in input order when the
folder has dsv4enc's ``_manifest.json``, else in sorted file order). Only a few rows are in
memory at a time; values come back exactly as stored (float16 stays float16)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .. import storage
from ..columns import OUTPUT_METADATA_KEY
from ..errors import SettingsError, UsageError, check_flag, check_positive
from .files import LOCK_NAME, MANIFEST_FILE, PART_FILE, PARTIAL, journal_path, segment_chain
from .lock import holder_if_locked, holder_text

#: What a manifest's journal starts with (docs/output-format.md#the-manifest-and-its-journal).
JOURNAL_FORMAT = "dsv4enc-journal"

#: Rows per Arrow batch while streaming, at most (a row of the full model is up to ~3 MB in
#: float16: fewer of those, by ``BATCH_BYTES``).
BATCH_ROWS = 16
#: Listings of a folder a reader makes at most while a running bucket output merges the
#: journal segments it reads (each merge replaces segments; a reader reads the survivors).
LISTINGS = 3
#: How a reader's line ends for a folder output whose committed part is gone or cut short.
REPAIRABLE = ("the output is damaged; rerun its encode command with --update to repair it "
              "(with --resume, if that run did not finish)")


@dataclass(frozen=True)
class OutputFiles:
    """An output's Parquet files in input order, on the file system that reads them (local:
    memory-mapped; a store's: ranged reads), as ``find_output`` found them."""

    location: str  # as given: a local path or a URL (never through pathlib)
    fs: Any  # pyarrow.fs.FileSystem
    root: str  # the output's path in ``fs``
    paths: list[str]  # the Parquet files' paths in ``fs``
    sizes: list[int]  # their sizes in bytes
    manifests: list[dict]  # a folder's manifests, their journals applied (none: a single file)
    folder_bytes: int = 0  # every file's bytes under a folder (a single file: its own)
    locked: bool = False  # a folder holding a run's lock file: a run writes it, or was killed
    mtimes: dict[str, int] = field(default_factory=dict)  # each path's time of change, listed

    def name(self, path: str) -> str:
        """``path`` as messages show it: under ``location`` as the user wrote it."""
        return _shown(self.location, self.root, path)

    def open(self, path: str, metadata: Any = None, size: int | None = None, rows: bool = True):
        """A ``pyarrow.parquet.ParquetFile`` over ``path`` (a store's: ranged reads, the
        column chunks asked for fetched together). ``metadata`` and ``size``: its footer and
        size as an earlier open read them: the footer is not read again, and a file of
        another size is another file. A file gone or changed since the output was listed
        (``rewritten``, locally) is the output replaced meanwhile (``replaced``), never
        damage. A failure to open the file (the open-file limit, a store not answering) is
        named as it is, apart from a file whose content is no Parquet, or whose column
        chunks' metadata does not fit its schema (``check_column_chunks``, at its first open
        for ``rows``; not for a look at its schema alone)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        remote = self.fs.type_name != "local"  # a local file is memory-mapped: no copies
        try:
            source = self.fs.open_input_file(path)
        except FileNotFoundError:  # listed, and gone since: no damage, a switched output
            raise self.replaced(path) from None
        except OSError as exc:
            raise storage.setup_error(f"{self.name(path)}: cannot open it", exc) from None
        if size is not None and source.size() != size or self.rewritten(path):
            source.close()
            raise self.replaced(path)
        try:
            handle = pq.ParquetFile(source, pre_buffer=remote, metadata=metadata)
            if rows and metadata is None:  # its first open: its footer checked once
                check_column_chunks(handle.metadata)
            return handle
        except (OSError, ValueError, pa.ArrowException) as exc:
            source.close()
            repair = f": {REPAIRABLE}" if self.manifests else ""  # a committed part: repairable
            raise UsageError(f"{self.name(path)}: not a readable Parquet file ({exc})"
                             f"{repair}") from None

    def rewritten(self, path: str) -> bool:
        """Whether the local file ``path`` changed since it was listed: its time of change is
        another, a later run's file under its name (--overwrite writes its parts under the old
        ones' names, of the same sizes where only the weights differ, so that the footer read
        before would read the new rows as the old output's). A store's object is not asked
        again (a request per file)."""
        listed = self.mtimes.get(path)
        if listed is None or self.fs.type_name != "local":
            return False
        try:
            return self.fs.get_file_info(path).mtime_ns != listed
        except OSError:
            return True

    def replaced(self, path: str) -> UsageError:
        """The error for a file listed in the output that is gone or changed since: the
        output was replaced (an --update's switch, an --overwrite) while it was read."""
        return UsageError(f"{self.name(path)}: gone or rewritten since the output was listed: "
                          "the output was replaced (by an --update or --overwrite) while it "
                          "was being read; read it again")


def check_column_chunks(meta: Any) -> None:
    """Raise a ValueError where a column chunk's metadata in footer ``meta`` does not fit the
    file's schema (its level histograms, its unencoded sizes, its count): pyarrow aborts the
    whole process (an uncaught C++ exception) building such a chunk's metadata in Python
    (``row_group(i).column(j)``, its ``statistics``), as readers do, so the footer's Thrift is
    read here by dsv4enc's own codec."""
    import pyarrow as pa

    from .parquet_join import (CHUNK_META, GROUP_COLUMNS, META_SIZE_STATISTICS, CompactReader,
                               row_groups)

    def field(struct: list, number: int, default: Any = ()) -> Any:  # of a decoded struct
        return next((f[2] for f in struct if f[0] == number), default)

    sink = pa.BufferOutputStream()
    meta.write_metadata_file(sink)  # PAR1, the footer's Thrift, its length, PAR1
    columns = [meta.schema.column(i) for i in range(len(meta.schema))]
    for group in row_groups(CompactReader(sink.getvalue().to_pybytes()[4:-8]).struct()):
        chunks = field(group, GROUP_COLUMNS, (0, []))[1]
        if len(chunks) != len(columns):
            raise ValueError(f"a row group has {len(chunks)} columns, its schema {len(columns)}")
        for chunk, column in zip(chunks, columns):
            sizes = field(field(chunk, CHUNK_META), META_SIZE_STATISTICS)
            for number, level, kind in ((2, column.max_repetition_level, "repetition"),
                                        (3, column.max_definition_level, "definition")):
                if len(field(sizes, number, (0, []))[1]) not in (0, level + 1):
                    raise ValueError(f"column {column.path!r}: its {kind} level histogram does "
                                     "not fit its schema")
            if field(sizes, 1, None) is not None and column.physical_type != "BYTE_ARRAY":
                raise ValueError(f"column {column.path!r}: unencoded byte sizes for "
                                 f"{column.physical_type} values")


def find_output(location: str | os.PathLike, storage_options: Any = None) -> OutputFiles:
    """The Parquet files of the output at ``location`` (a local path or a URL: ``s3://``,
    ``gs://``, any fsspec scheme; ``storage_options`` as ``--storage-option`` takes them): the
    file itself, or a folder's committed part files in input order. A folder with manifests
    shows only the parts they list (a part file not yet committed is skipped); one with a run's
    lock but no manifest yet, none; any other, every ``.parquet`` file below it in sorted order
    (names starting with ``.`` or ``_`` skipped). A folder whose manifest lists a part that
    is not there, or a part entry the format does not describe, is damaged: a UsageError."""
    import pyarrow.fs as pafs

    text = os.fspath(location)
    fs, root = storage.locate(text, storage_options)
    try:
        info = fs.get_file_info(root)
    except OSError as exc:
        raise storage.setup_error(text, exc) from None
    if info.type == pafs.FileType.File:
        return OutputFiles(text, fs, root, [root], [info.size], [], info.size,
                           mtimes={root: info.mtime_ns})
    if info.type != pafs.FileType.Directory:
        raise UsageError(f"no such file or folder: {text}")
    listed, manifests = _list_folder(fs, root, text)
    paths = _committed_paths(root, manifests)
    for _ in range(LISTINGS):
        if all(p in listed for p in paths):
            break
        # A part committed (or a folder switched into place by an --update) after the listing
        # is in a listing made after its manifest was read; one missing from that is gone.
        later, manifests_later = _list_folder(fs, root, text)
        if all(p in later for p in paths):
            listed = later
            break
        listed, manifests = later, manifests_later
        paths = _committed_paths(root, manifests)
    gone = [p for p in paths if p not in listed]
    if gone:
        more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
        raise UsageError(f"{_shown(text, root, gone[0])}{more}: missing, though the manifest "
                         f"lists it: {REPAIRABLE}")
    locked = f"{root}/{LOCK_NAME}" in listed
    if not manifests and not locked:  # (locked: a run writes it, or was killed, before a commit)
        paths = sorted((p for p in listed if _visible(p[len(root):].strip("/"))),
                       key=lambda p: p[len(root):].strip("/").split("/"))
    return OutputFiles(text, fs, root, paths, [listed[p].size for p in paths], manifests,
                       sum(f.size for f in listed.values()), locked,
                       {p: listed[p].mtime_ns for p in paths})


def interrupted_folder(path: str | os.PathLike, storage_options: Any = None) -> str | None:
    """The parts folder of an interrupted run that ``path`` names: ``OUT.partial/`` itself,
    or ``OUT.partial`` when only that exists (as ``path`` is written); else None."""
    import pyarrow.fs as pafs

    text = os.fspath(path)
    fs, root = storage.locate(text, storage_options)
    try:
        if root.endswith(PARTIAL):
            return text if fs.get_file_info(root).type == pafs.FileType.Directory else None
        there, beside = fs.get_file_info([root, root + PARTIAL])
    except (OSError, ValueError) as exc:  # ValueError: a URL pyarrow cannot address (``//``)
        raise storage.setup_error(text, exc) from None
    if there.type == pafs.FileType.NotFound and beside.type == pafs.FileType.Directory:
        return text.rstrip("/") + PARTIAL
    return None


def live_writer(folder: str) -> dict[str, Any] | None:
    """The live run that holds the lock of the parts folder ``folder``, as ``holder_if_locked``
    gives it (its pid, host and since); None where none does, or ``folder`` is in a bucket (its
    lock object is not read here)."""
    local = storage.local_path(folder)
    return None if local is None else holder_if_locked(Path(local) / LOCK_NAME)


def being_written(path: str | os.PathLike, storage_options: Any = None) -> dict[str, Any] | None:
    """The live run writing the output ``path`` names (``live_writer``) where that is a single
    file not there until its run ends (only its ``OUT.partial/``), what ``inspect`` shows as
    "being written"; None where no run is writing it so."""
    partial = interrupted_folder(path, storage_options)
    return None if partial is None else live_writer(partial)


def readable_output(location: str | os.PathLike, storage_options: Any = None) -> OutputFiles:
    """``find_output``'s files, for a reader of rows: refused in one line (a UsageError) where
    they would read as no rows but are not an empty output: an unfinished single-file run's
    parts (ranges of its growing file, no Parquet file until it finishes), or a folder that
    holds no Parquet file and no run's manifest or lock; and a single file that is not there
    yet, in place of "no such file or folder", as ``inspect`` names it: being written by a
    live run (``being_written``; there once the run ends), else its run interrupted (only
    its ``OUT.partial/``: the same command with ``--resume`` finishes it)."""
    try:
        found = find_output(location, storage_options)
    except UsageError:
        writing = being_written(location, storage_options)
        if writing is not None:
            raise UsageError(f"{location}: being written by a run{holder_text(writing)}: read "
                             "it when the run ends") from None
        partial = interrupted_folder(location, storage_options)
        if partial is None:
            raise
        raise UsageError(f"{location}: an interrupted run, not finished (its parts in "
                         f"{partial}): rerun the same command with --resume to finish it (in "
                         "place of --overwrite, if it had one)") from None
    if any("file" not in part for data in found.manifests for part in data["parts"].values()):
        raise UsageError(f"{location}: an unfinished single-file run's parts, ranges of its "
                         "growing file: its rows read once the run has finished (rerun it "
                         "with --resume if it was stopped)")
    if not (found.paths or found.manifests or found.locked):
        raise UsageError(f"{location}: no Parquet files found")
    return found


def _shown(location: str, root: str, path: str) -> str:
    """``path`` (in the output's file system) under ``location`` as the user wrote it."""
    below = path[len(root):].strip("/")
    return f"{location.rstrip('/')}/{below}" if below else location


def _list_folder(fs, root: str, text: str) -> tuple[dict[str, Any], list[dict]]:
    """The files below the folder ``root`` by path, and its dsv4enc manifests (their journals
    applied, their part entries checked: ``check_parts``), read after the listing."""
    import pyarrow.fs as pafs

    for _ in range(LISTINGS):
        try:
            found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
            listed = {f.path: f for f in found if f.type == pafs.FileType.File}
            manifests = []
            for path in sorted(p for p in listed
                               if MANIFEST_FILE.fullmatch(p[len(root):].strip("/"))):
                data = _read_manifest(fs, path, listed, _shown(text, root, path))
                if data is not None:
                    check_parts(data, _shown(text, root, path))
                    manifests.append(data)
            return listed, manifests
        except SegmentGone:
            continue
        except OSError as exc:
            raise storage.setup_error(text, exc) from None
    raise UsageError(f"{text}: its journal kept changing while it was read; read it again")


def _committed_paths(root: str, manifests: list[dict]) -> list[str]:
    """The paths of the part files ``manifests`` list, in input order."""
    parts = [part for data in manifests for part in data["parts"].values() if "file" in part]
    parts.sort(key=lambda p: (p["start"], p["file"]))
    return [f"{root}/{name}" for name in dict.fromkeys(p["file"] for p in parts)]


#: The types of a manifest's part entry (docs/output-format.md#part-files): of the keys every
#: entry holds, then of those an entry may hold (``file``, or ``offset`` and ``length``: a
#: range of a single file's growing file).
PART_KEYS: dict[str, type] = {"start": int, "end": int, "rows": int}
MAYBE_PART_KEYS: dict[str, type] = {"file": str, "digest": str, "size": int, "failed": int,
                                    "transient": int, "offset": int, "length": int,
                                    "share": str}


#: How a reader's line ends for an output whose manifest is damaged.
DAMAGED = "the output is damaged; encode it again (--overwrite, or a new --out)"


def check_parts(data: dict, shown: str) -> None:
    """Refuse in one line (a UsageError) a dsv4enc manifest, shown as ``shown``, whose part
    entries the format does not describe: every reader of a folder's parts reads them."""
    for name, part in data["parts"].items():
        why = part_fault(part)
        if why is not None:
            raise UsageError(f"{shown}: its part {name!r} {why}: {DAMAGED}")


def part_fault(part: Any) -> str | None:
    """What makes ``part`` no manifest part entry of the format, or None where it is one."""
    if not isinstance(part, dict):
        return "is not an object"
    missing = [key for key in PART_KEYS if key not in part]
    if missing:
        return f"has no {missing[0]!r}"
    for key, kind in {**PART_KEYS, **MAYBE_PART_KEYS}.items():
        value = part.get(key, kind())
        if not isinstance(value, kind) or isinstance(value, bool):
            noun = "an integer" if kind is int else "a string"
            return f"has {key!r} {json.dumps(value)}, not {noun}"
    if "file" in part:
        if not PART_FILE.fullmatch(part["file"]):
            return f"names {json.dumps(part['file'])}, not a part file of its folder"
    elif not ("offset" in part and "length" in part):
        return "names no part file (nor a range of the growing file)"
    return None


def _visible(relative: str) -> bool:
    """A Parquet file that readers of a folder take: no part of its path hidden (``.``, ``_``)."""
    names = relative.split("/")
    return names[-1].endswith(".parquet") and not any(n.startswith((".", "_")) for n in names)


def _read_manifest(fs, path: str, listed: Iterable[str], shown: str) -> dict | None:
    """The manifest at ``path`` in ``fs`` (``shown`` in messages), its journal applied
    (``listed``: the folder's paths); None if it is not dsv4enc's (another tool's
    ``_manifest.json`` leaves the folder read as plain Parquet files); one that is not JSON
    is damage, a UsageError (read as plain files, a killed run's uncommitted parts would be
    rows). Raises ``SegmentGone``: list the folder again."""
    try:
        data = load_manifest(path, fs, listed)
    except SegmentGone:
        raise
    except ValueError:
        # --overwrite replaces no folder whose manifest is not provably dsv4enc's: not this one
        raise UsageError(f"{shown}: not JSON: the output is damaged; encode it again into a "
                         "new --out (--overwrite keeps a folder whose manifest it cannot "
                         "read)") from None
    except OSError:
        return None
    return data if is_dsv4enc_document(data) and isinstance(data.get("parts"), dict) else None


def output_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files of a local output (``find_output``), under ``path`` as given."""
    found = find_output(path)
    return [Path(found.name(p)) for p in found.paths]


def _read_bytes(path: str | os.PathLike, fs=None) -> bytes:
    if fs is None:
        return Path(path).read_bytes()
    with fs.open_input_stream(os.fspath(path)) as handle:
        return handle.read()


def load_manifest(path: str | os.PathLike, fs=None, listed: Iterable[str] = ()) -> Any:
    """A manifest's JSON with the parts its journal committed since it was last written whole
    (raises OSError, ValueError); every reader of the committed parts goes through here. A run
    appends one synced line per part to the journal, so a commit costs the same at part 10 and
    10^5; the journal applies when its header names the manifest's ``journal`` token, and its
    last line's ``inputs`` (the images listed by then) replaces the manifest's. ``fs``: the
    pyarrow file system ``path`` is in (None: local) and ``listed`` the paths its folder holds
    there: the journal is read where it is listed, and in a bucket the journal's segments
    (``files.segment_chain``; a chained segment deleted meanwhile, by a merge, raises
    ``SegmentGone``: list again). A journal gone or of another token may be one that a run
    deleted once it wrote the manifest whole again, after it was read (``written_anew``)."""
    raw = _read_bytes(path, fs)
    data = json.loads(raw)
    if (isinstance(data, dict) and isinstance(data.get("parts"), dict)
            and isinstance(data.get("journal"), str)):
        token, listed = data["journal"], set(listed)
        journal = journal_path(os.fspath(path))
        journals = [_read_journal(journal, fs)] if fs is None or journal in listed else []
        if journals and not opens_journal((journals[0] or b"").split(b"\n", 1)[0], token):
            written_anew(path, fs, raw)
        for segment in segment_chain(os.path.basename(os.fspath(path)), token, listed):
            content = _read_journal(segment, fs)
            if content is None:
                raise SegmentGone(f"{segment}: deleted while it was read (merged)")
            journals.append(content)
        for entry in (e for journal in journals for e in journal_entries(journal, token)):
            if "drop" in entry:
                for name in entry["drop"]:
                    data["parts"].pop(name, None)
                continue
            data["parts"][entry["name"]] = entry["part"]
            if isinstance(entry.get("inputs"), int):
                data["inputs"] = entry["inputs"]
    return data


def written_anew(path: str | os.PathLike, fs, raw: bytes) -> None:
    """Raise ``SegmentGone`` (list again) where the manifest at ``path`` is no longer
    ``raw``, as it was read: a run wrote it whole meanwhile (under a new journal token; its
    parts then hold what the journal that it deleted held). Its bytes are compared, not
    parsed again: a finished output's journal is always gone."""
    try:
        same = _read_bytes(path, fs) == raw
    except OSError:
        same = False
    if not same:
        raise SegmentGone(f"{path}: written anew while its journal was read")


class SegmentGone(FileNotFoundError):
    """A journal segment in a bucket was replaced by a merged one while a reader read it."""


def _read_journal(path: str, fs) -> bytes | None:
    """A journal's bytes; None where it is missing (an empty journal)."""
    try:
        return _read_bytes(path, fs)
    except FileNotFoundError:
        return None


def is_dsv4enc_document(data: Any) -> bool:
    """``data`` names dsv4enc as the tool of its settings (a manifest of any version)."""
    settings = data.get("settings") if isinstance(data, dict) else None
    return isinstance(settings, dict) and settings.get("tool") == "dsv4enc"


def journal_entries(data: bytes | None, token: str) -> Iterator[dict]:
    """The entries of a journal's bytes ``data``, one per whole line, in commit order, if its
    header names ``token`` (else none): a commit (``name``, ``part``, maybe ``inputs``) or
    the parts a resume dropped (``drop``: their names); a last line without its newline is a
    torn write, ignored."""
    for number, line in enumerate((data or b"").splitlines(keepends=True)):
        if not line.endswith(b"\n"):
            return  # torn: the write of the last commit did not finish
        if number == 0:
            if not opens_journal(line, token):
                return
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            return
        if not isinstance(entry, dict) or not (
                isinstance(entry.get("name"), str) and isinstance(entry.get("part"), dict)
                or isinstance(entry.get("drop"), list)
                and all(isinstance(name, str) for name in entry["drop"])):
            return
        yield entry


def opens_journal(line: bytes, token: str) -> bool:
    """Whether ``line`` is the header of the journal of the manifest whose token is ``token``
    (a journal of another token is stale: a manifest written whole since replaced it)."""
    try:
        header = json.loads(line)
    except ValueError:
        return False
    return (isinstance(header, dict) and header.get("format") == JOURNAL_FORMAT
            and header.get("manifest") == token)


@dataclass(frozen=True)
class EmbeddingFormat:
    """How to read an output's ``embedding`` column: its layout, stored dtype, row width and
    whether each cell is one pooled vector (``(width,)``) rather than ``(rows, width)``."""

    layout: str
    dtype: str
    width: int
    pooled: bool

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")


_FLOAT_NAMES = {"halffloat": "float16", "float": "float32", "double": "float64"}


def embedding_format(schema, shown: str | None = None) -> EmbeddingFormat:
    """The ``embedding`` column's format, from an output's Arrow schema and its ``dsv4enc``
    metadata (which a ``binary`` column needs; a nested list of floats reads without it).
    ``shown``: the file as messages name it (in a folder of parts, which one is refused)."""
    import pyarrow as pa

    where = f"{shown}: " if shown else ""
    kind = schema.field("embedding").type
    described = metadata_of(schema).get("embedding")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        if not isinstance(described, dict):
            raise UsageError(f"{where}a binary embedding column without the dsv4enc metadata "
                             "naming its dtype and width (not written by dsv4enc, or "
                             "rewritten by a tool that dropped the Parquet metadata)")
        return EmbeddingFormat("binary", str(described["dtype"]), int(described["width"]),
                               bool(described.get("pooled", False)))
    pooled = pa.types.is_fixed_size_list(kind)
    row = kind if pooled else kind.value_type
    if not pa.types.is_fixed_size_list(row) or not pa.types.is_floating(row.value_type):
        raise UsageError(f"{where}unknown embedding column type {kind}")
    return EmbeddingFormat("nested", _FLOAT_NAMES[str(row.value_type)], row.list_size, pooled)


def metadata_of(schema) -> dict[str, Any]:
    """The ``dsv4enc`` metadata of an Arrow schema (a dict; {} if it has none)."""
    raw = (schema.metadata or {}).get(OUTPUT_METADATA_KEY)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def embedding_arrays(column, fmt: EmbeddingFormat | None = None) -> list[np.ndarray | None]:
    """One numpy array per row of an ``embedding`` Arrow column: (rows, width), or (width,)
    for pooled vectors; None where the value is null. Copies, exact dtype. ``fmt`` is needed
    for the binary layout (its cells do not say their dtype or width)."""
    return [None if view is None else owned_copy(view)
            for view in embedding_views(column, fmt)]


def embedding_views(column, fmt: EmbeddingFormat | None = None) -> list[np.ndarray | None]:
    """``embedding_arrays`` without the copies: read-only arrays over the column's own
    buffers (each keeps its buffer alive; nothing is freed under it)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return [a for chunk in column.chunks for a in embedding_views(chunk, fmt)]
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        if fmt is None:
            raise ValueError("a binary embedding column needs its EmbeddingFormat")
        return _binary_views(column, fmt)
    valid = valid_mask(column)
    if pa.types.is_fixed_size_list(column.type):  # pooled: one vector per row
        width = column.type.list_size
        flat = column.values.slice(column.offset * width, len(column) * width)
        matrix = _read_only(flat.to_numpy(zero_copy_only=False).reshape(len(column), width))
        return [matrix[i] if valid[i] else None for i in range(len(column))]
    width = column.type.value_type.list_size
    offsets = column.offsets.to_numpy()
    lo, hi = int(offsets[0]), int(offsets[-1])
    vectors = column.values.slice(lo, hi - lo)
    flat = vectors.values.slice(vectors.offset * width, (hi - lo) * width)
    matrix = _read_only(flat.to_numpy(zero_copy_only=False).reshape(hi - lo, width))
    return [matrix[offsets[i] - lo:offsets[i + 1] - lo] if valid[i] else None
            for i in range(len(column))]


def valid_mask(column) -> np.ndarray:
    """Which values of an Arrow array are not null, as a bool array, read from its validity
    bitmap (``pyarrow.Array.is_valid`` would import ``pyarrow.compute``: 0.2 s of a short read)."""
    validity = column.buffers()[0]
    if column.null_count == 0 or validity is None:
        return np.ones(len(column), dtype=bool)
    bits = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
    return bits[column.offset:column.offset + len(column)].astype(bool)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def owned_copy(view: np.ndarray) -> np.ndarray:
    """A writable copy of a view in the machine's byte order (a plain copy where that is
    already little-endian: faster than ``astype``)."""
    return view.copy() if view.dtype.isnative else view.astype(view.dtype.newbyteorder("="))


def _binary_views(column, fmt: EmbeddingFormat) -> list[np.ndarray | None]:
    """Cells of a (large_)binary column as read-only arrays over the column's data buffer."""
    import pyarrow as pa

    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[
        column.offset:column.offset + len(column) + 1]
    data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None
            else np.zeros(0, np.uint8))
    valid = valid_mask(column)
    stored = fmt.numpy_dtype
    shape = (fmt.width,) if fmt.pooled else (-1, fmt.width)
    return [_read_only(data[offsets[i]:offsets[i + 1]].view(stored).reshape(shape))
            if valid[i] else None for i in range(len(column))]


#: Bytes of embeddings per Arrow batch while streaming, when ``batch_rows`` is not given: a
#: batch near the CPU's cache sizes reads faster than fresh buffers paged in for each batch.
BATCH_BYTES = 8 << 20
#: With ``copy=True``, rows of at least this many bytes are read one per batch, so that the
#: buffer Arrow decodes a row into holds that row alone and can be handed over, not copied.
OWN_BATCH_BYTES = 1 << 20


def sole_row_array(column, row: np.ndarray | None) -> np.ndarray | None:
    """``row``, the view of a one-row binary ``embedding`` column's cell, made writable where
    the column's data buffer holds this row alone (not a slice of a larger one) and may be
    written: a buffer Arrow decoded for this batch, which nothing reads once the batch is
    dropped. None where the row must be copied to be the caller's own."""
    import pyarrow as pa

    if row is None or len(column) != 1 or not (pa.types.is_binary(column.type)
                                               or pa.types.is_large_binary(column.type)):
        return None
    data = column.buffers()[2]
    if (data is None or not data.is_mutable or data.parent is not None
            or row.nbytes != data.size or not row.dtype.isnative):
        return None
    row.flags.writeable = True  # the buffer is the row's alone: nothing else sees the writes
    return row


def read_embeddings(path: str | os.PathLike, columns: Sequence[str] | None = None, *,
                    errors: str = "skip", batch_rows: int | None = None,
                    copy: bool = True, storage_options: Any = None) -> Iterator[Any]:
    """Stream the rows of a dsv4enc output (a Parquet file or a dataset folder), local or at a
    URL (``s3://``, ``gs://``, any fsspec scheme; ``storage_options``: a dict of the file
    system's options, or ``KEY=VALUE`` texts as ``--storage-option`` takes them).

    Without ``columns``: yields ``(path, embedding, (grid_h, grid_w))`` per row, where
    ``embedding`` is a numpy array of shape (grid_h*grid_w, width) in the stored dtype (or
    (width,) for a ``--pool mean`` output). With ``columns=[...]``: yields a dict of those
    columns per row (``embedding`` as above, other columns as Python values).

    ``errors="skip"`` (default) passes over rows whose image failed; ``errors="include"``
    yields them too, with ``None`` for the embedding and grid (dicts: the stored nulls).
    Embeddings are the caller's own (writable, sharing memory with nothing): copies, or for a
    row of ``OWN_BATCH_BYTES`` or more, read in a batch of its own, the buffer Arrow decoded
    it into. ``copy=False`` yields read-only views of the batch instead of copies (faster for
    small rows; each view keeps its whole batch alive). Memory stays at one batch
    (``batch_rows`` rows; default: about ``BATCH_BYTES`` of embeddings, at most
    ``BATCH_ROWS`` rows, one where ``copy`` and a row holds ``OWN_BATCH_BYTES``),
    memory-mapped, and what the caller keeps, whatever the file's size."""
    if errors not in ("skip", "include"):
        raise ValueError(f"errors must be 'skip' or 'include', not {errors!r}")
    if batch_rows is not None:  # 0 is no default: checked, as the encoder's options are
        check_positive("batch_rows", batch_rows)
    check_flag("copy", copy)  # "no" is truthy
    wanted = column_names(columns) if columns is not None else None
    need = (wanted or ["path", "grid_h", "grid_w", "embedding"]).copy()
    if errors == "skip" and "error" not in need:
        need.append("error")
    found = readable_output(path, storage_options)
    for file in found.paths:
        handle = found.open(file)
        names = handle.schema_arrow.names
        unknown = [c for c in need if c not in names]
        if unknown:
            raise UsageError(f"{found.name(file)}: no column {unknown[0]!r} "
                             f"(columns: {', '.join(names)})")
        fmt = (embedding_format(handle.schema_arrow, found.name(file)) if "embedding" in need
               else None)
        rows = batch_rows or _rows_per_batch(handle, "embedding" in need, copy)
        for batch in handle.iter_batches(batch_size=rows, columns=need):
            yield from _batch_rows(batch, need, wanted, fmt, errors == "skip", copy)


def column_names(columns: Sequence[str]) -> list[str]:
    """``columns`` as a list, or a SettingsError where it is one text: ``"caption"`` is a
    sequence of its letters, read as the columns c, a, p, ... ("no column 'c'", of a file
    that has a caption column)."""
    if isinstance(columns, str):
        raise SettingsError(f"columns must be a list of column names, not the text {columns!r} "
                            f"(columns=[{columns!r}] for that column)")
    return list(columns)


def _rows_per_batch(handle, embeddings: bool, copy: bool) -> int:
    """Rows per batch that hold about BATCH_BYTES of embeddings (the first row group's
    mean), at most BATCH_ROWS; one where rows of OWN_BATCH_BYTES are to be copied."""
    meta = handle.metadata
    if not embeddings or meta.num_row_groups == 0 or meta.row_group(0).num_rows == 0:
        return BATCH_ROWS
    group = meta.row_group(0)
    column = next((group.column(i) for i in range(group.num_columns)
                   if group.column(i).path_in_schema.split(".")[0] == "embedding"), None)
    if column is None:
        return BATCH_ROWS
    per_row = column.total_uncompressed_size / group.num_rows
    if copy and per_row >= OWN_BATCH_BYTES:
        return 1
    return max(1, min(BATCH_ROWS, int(BATCH_BYTES // max(per_row, 1))))


def _batch_rows(batch, need: list[str], wanted: list[str] | None, fmt, skip: bool,
                copy: bool) -> Iterator[Any]:
    """One Arrow batch's rows, as ``read_embeddings`` yields them. Each embedding is copied
    only when its row is yielded: a caller that drops each row holds one or two copies, whose
    memory the allocator reuses, instead of a batch of fresh ones. A batch of one large row
    hands its buffer over instead (``sole_row_array``): one copy in all, Arrow's decode."""
    data = {name: batch.column(name) for name in need}
    views = embedding_views(data["embedding"], fmt) if "embedding" in data else None
    if copy and views is not None and len(views) == 1:
        handed = sole_row_array(data["embedding"], views[0])
        if handed is not None:
            views, copy = [handed], False
    failed = valid_mask(data["error"]) if skip else None
    plain = {n: data[n].to_pylist() for n in need if n != "embedding"}
    for i in range(batch.num_rows):
        if failed is not None and failed[i]:
            continue
        embedding = None
        if views is not None and views[i] is not None:
            embedding = owned_copy(views[i]) if copy else views[i]
        if wanted is not None:
            yield {n: (embedding if n == "embedding" else plain[n][i]) for n in wanted}
            continue
        grid = None if embedding is None else (plain["grid_h"][i], plain["grid_w"][i])
        yield plain["path"][i], embedding, grid


def read_metadata(path: str | os.PathLike, storage_options: Any = None) -> dict[str, Any]:
    """The ``dsv4enc`` metadata of an output (its first file's), or {} if there is none."""
    found = find_output(path, storage_options)
    if not found.paths:
        return {}
    return metadata_of(found.open(found.paths[0], rows=False).schema_arrow)


def is_dsv4enc_parquet(path: str | os.PathLike) -> bool:
    """A Parquet file (or object) whose footer carries dsv4enc's metadata (read from the
    footer only)."""
    try:
        return read_metadata(path).get("tool") == "dsv4enc"
    except Exception:  # not Parquet, unreadable, ...: not provably ours
        return False
