"""Parquet output (docs/output-format.md, "Part files"): crash-safe part files, a manifest,
and the final file.

Each part is written under a hidden temporary name, fsynced and renamed, then the manifest
records it (one synced line appended to its journal; the manifest is written whole when a run
starts, resumes or finishes). A kill leaves only whole parts, which ``--resume`` reuses. A
single-file ``--out`` is joined from the parts (one local process skips the part files:
``appending.py``, a ``PartStore`` that keeps the manifest the same way)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import storage
from ..columns import INT_COLUMNS, OUTPUT_COLUMNS, OUTPUT_METADATA_KEY, utf8_text
from ..errors import PARTS_KEPT, DsvError, OutputError, check_choice, output_os_error
from . import DEFAULT_LAYOUT, LAYOUTS
from ..images.sources import kept_values
from ..images.decode import is_transient
from .parquet_join import JoinError, ParquetJoiner
from ..version import __version__
from .files import (MANIFEST_FILE, MANIFEST_NAME, PART_FILE, STAMPS_FILE, journal_path, part_file,
                    temp_path)
from .read import (JOURNAL_FORMAT, check_column_chunks, check_parts, embedding_format,
                   is_dsv4enc_document, load_manifest)

if TYPE_CHECKING:
    import torch

    from ..tower.config import VisionConfig

log = logging.getLogger("dsv4enc")

#: What a manifest says it is: dsv4enc recognises its own manifests by content, not by name.
MANIFEST_FORMAT = "dsv4enc-parts"
MANIFEST_VERSION = 2
ROW_GROUP_BYTES = 64 << 20
DATA_PAGE_BYTES = 8 << 20
_ARROW_FLOAT = {"float16": pa.float16(), "float32": pa.float32()}


def output_schema(width: int, out_dtype: str, metadata: dict[str, Any] | None = None,
                  pooled: bool = False, layout: str = DEFAULT_LAYOUT,
                  kept: Sequence[pa.Field] = ()) -> pa.Schema:
    """The output schema; ``metadata`` goes under the ``dsv4enc`` key as JSON, with an
    ``embedding`` entry that says how to read the column (``read.embedding_format``). ``kept``:
    the input tables' columns the rows carry (``--keep-column``, the typed ``--key-column``).
    ``layout`` (benchmarks/RESULTS.md): ``binary`` stores each image's (rows, width) array as
    one binary cell, written and read at memory speed; ``nested`` stores float lists, which
    tools read as numbers at ~20x the CPU."""
    check_choice("layout", layout, LAYOUTS)
    if layout == "binary":
        embedding = pa.large_binary()  # 64-bit offsets: a part may hold over 2 GiB
    else:
        row = pa.list_(_ARROW_FLOAT[out_dtype], width)
        embedding = row if pooled else pa.list_(row)
    fields = [pa.field("path", pa.string(), nullable=False),
              *(pa.field(name, pa.int32()) for name in INT_COLUMNS),
              pa.field("embedding", embedding), pa.field("error", pa.string()), *kept]
    described = {"layout": layout, "dtype": out_dtype, "width": width, "pooled": pooled,
                 "shape": [width] if pooled else ["grid_h*grid_w", width],
                 "byte_order": "little"}
    meta = {OUTPUT_METADATA_KEY: json.dumps({**(metadata or {}), "embedding": described},
                                   sort_keys=True).encode()}
    return pa.schema(fields, metadata=meta)


def run_settings(cfg: VisionConfig, fingerprint: str, dtype: torch.dtype | str,
                 device_type: str, batch_invariant: bool, *, out_dtype: torch.dtype | str,
                 features: str, pool: str, layout: str, fused: bool = False) -> dict:
    """What the rows were computed with (a run adds its ``part_images``); ``--resume``
    requires these to match. ``batch_invariant``: whether each row's bytes are independent
    of its batch, a guarantee per device kind, dtype and software stack (so those match too);
    ``fused``: compiled elementwise kernels made them (equal to the eager tower's to rounding)."""
    return {"tool": "dsv4enc", "version": __version__, "config": cfg.to_flat(),
            "weights_fingerprint": fingerprint,
            "compute_dtype": str(dtype).removeprefix("torch."), "device": device_type,
            "batch_invariant": batch_invariant, "out_dtype": str(out_dtype).removeprefix("torch."),
            "features": features, "pool": pool, "layout": layout, "fused": fused}


@dataclass
class Row:
    """One output row. ``embedding`` is (grid_h*grid_w, width) (or (width,) pooled), or None."""

    path: str
    width: int | None = None
    height: int | None = None
    vit_h: int | None = None
    vit_w: int | None = None
    grid_h: int | None = None
    grid_w: int | None = None
    embedding: np.ndarray | None = None
    error: str | None = None


# Arrays are built from numpy buffers with ``Array.from_buffers``: ``pa.array`` would import
# pandas on its first call (to check for pandas inputs), 0.2 s of a short run's start-up.

def _validity(valid: np.ndarray) -> pa.Buffer | None:
    """Arrow's validity bitmap (LSB first) for a bool mask; None when nothing is null."""
    return None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))


def _numeric_array(values: np.ndarray, arrow_type: pa.DataType,
                   valid: np.ndarray | None = None) -> pa.Array:
    """A zero-copy Arrow view of a contiguous 1-D numpy array of ``arrow_type``'s width."""
    values = np.ascontiguousarray(values)
    validity = None if valid is None else _validity(valid)
    return pa.Array.from_buffers(arrow_type, len(values), [validity, pa.py_buffer(values)])


def _int32_array(values: Sequence[int | None]) -> pa.Array:
    valid = np.array([v is not None for v in values], dtype=bool)
    data = np.array([0 if v is None else v for v in values], dtype=np.int32)
    return _numeric_array(data, pa.int32(), valid)


def _string_array(values: Sequence[str | None]) -> pa.Array:
    valid = np.array([v is not None for v in values], dtype=bool)
    encoded = [b"" if v is None else v.encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return pa.Array.from_buffers(pa.large_string(), len(encoded), [
        _validity(valid), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]).cast(pa.string())


def kept_fields(schema: pa.Schema) -> list[pa.Field]:
    """The fields of ``schema`` that carry input table columns (``--keep-column``)."""
    return [field for field in schema if field.name not in OUTPUT_COLUMNS]


def kept_columns(schema: pa.Schema, items: Sequence) -> dict[str, pa.Array] | None:
    """``schema``'s kept columns' values for ``items`` (``items.InputItem``s, in row order),
    or None."""
    fields = kept_fields(schema)
    return kept_values(items, fields) if fields else None


def rows_to_table(rows: Sequence[Row], schema: pa.Schema,
                  kept: dict[str, pa.Array] | None = None) -> pa.Table:
    """Build an Arrow table from rows; embeddings go in as one flat buffer, no Python floats.
    ``kept``: the kept columns' values (``images/sources.kept_values``); one not given is null."""
    fmt = embedding_format(schema)
    embedding = (_binary_embeddings(rows, fmt) if fmt.layout == "binary"
                 else _nested_embeddings(rows, schema.field("embedding").type, fmt))
    columns = {
        "path": _string_array([utf8_text(r.path) for r in rows]),
        **{name: _int32_array([getattr(r, name) for r in rows]) for name in INT_COLUMNS},
        "embedding": embedding,
        "error": _string_array([r.error for r in rows]),
    }
    for field in schema:
        if field.name not in columns:
            given = (kept or {}).get(field.name)
            columns[field.name] = pa.nulls(len(rows), field.type) if given is None else given
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


_NULL_CELL = np.zeros(1, dtype=np.uint8)  # validity bitmap of a one-row null chunk


def _binary_embeddings(rows: Sequence[Row], fmt) -> pa.ChunkedArray:
    """One large_binary cell per row: the embedding's bytes (stored dtype, little-endian, C
    order), null for failed rows. Zero-copy: each row is a one-value chunk over its own array
    (cast only if not in the stored dtype), so the Parquet writer's copy is the only one."""
    dtype = fmt.numpy_dtype
    shape = (fmt.width,) if fmt.pooled else (-1, fmt.width)
    chunks = []
    for r in rows:
        if r.embedding is None:
            chunks.append(pa.Array.from_buffers(pa.large_binary(), 1, [
                pa.py_buffer(_NULL_CELL), pa.py_buffer(np.zeros(2, np.int64)), pa.py_buffer(b"")]))
            continue
        values = np.ascontiguousarray(np.asarray(r.embedding).reshape(shape), dtype=dtype)
        offsets = np.array([0, values.nbytes], dtype=np.int64)
        chunks.append(pa.Array.from_buffers(pa.large_binary(), 1, [
            None, pa.py_buffer(offsets), pa.py_buffer(values.reshape(-1).view(np.uint8))]))
    return pa.chunked_array(chunks, type=pa.large_binary())


def _nested_embeddings(rows: Sequence[Row], emb_type: pa.DataType, fmt) -> pa.Array:
    """The ``nested`` layout: list<fixed_size_list<float, width>> (fixed_size_list pooled)."""
    row_type = emb_type if fmt.pooled else emb_type.value_type
    width = fmt.width
    np_dtype = np.dtype(fmt.dtype)
    valid = np.array([r.embedding is not None for r in rows], dtype=bool)
    if fmt.pooled:
        # One vector per row; failed rows hold zeros under a null mask.
        flat = np.zeros((len(rows), width), dtype=np_dtype)
        for i, r in enumerate(rows):
            if r.embedding is not None:
                flat[i] = np.asarray(r.embedding, dtype=np_dtype).reshape(width)
        values = _numeric_array(flat.reshape(-1), row_type.value_type)
        return pa.Array.from_buffers(row_type, len(rows), [_validity(valid)], children=[values])
    arrays = [np.asarray(r.embedding, dtype=np_dtype).reshape(-1, width)
              for r in rows if r.embedding is not None]
    flat = np.concatenate(arrays).reshape(-1) if arrays else np.zeros(0, dtype=np_dtype)
    # Built with the schema's own types (child field names included): a mismatch would make
    # Table.from_arrays cast, i.e. copy, every value.
    vectors = pa.Array.from_buffers(row_type, len(flat) // width, [None],
                                    children=[_numeric_array(flat, row_type.value_type)])
    counts = np.array([0 if r.embedding is None else len(r.embedding) for r in rows],
                      dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.Array.from_buffers(emb_type, len(rows), [_validity(valid), pa.py_buffer(offsets)],
                                 children=[vectors])


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """Writer settings. Embeddings are near-random floats: dictionary encoding, statistics and
    compression cost several times the write time for a few percent of size, so only the small
    columns get them. 8 MiB data pages: fewer nested pages, faster to write and read
    (benchmarks/RESULTS.md)."""
    small = [name for name in schema.names if name != "embedding"]
    compression = {**{name: "zstd" for name in small}, "embedding": "none"}
    return {"compression": compression, "use_dictionary": small, "write_statistics": small,
            "data_page_size": DATA_PAGE_BYTES}


def write_parquet(table: pa.Table, where: Any, row_group_size: int) -> None:
    """Write ``table`` as a part's Parquet file to ``where`` (a path or a writable stream),
    with the writer settings every part has (``parquet_options``). A table of no rows gets
    no row group: a reader that sizes its batches by the first group's rows (Hugging Face
    ``datasets``) refuses a group of none."""
    if table.num_rows == 0:
        pq.ParquetWriter(where, table.schema, **parquet_options(table.schema)).close()
        return
    pq.write_table(table, where, row_group_size=row_group_size, **parquet_options(table.schema))


def rows_per_group(schema: pa.Schema, rows: Sequence[Row]) -> int:
    """Rows per row group for about ROW_GROUP_BYTES of embeddings (a quarter for nested float16:
    Parquet keeps float16 as 2-byte fixed-length binaries, which the writer handles at ~15 bytes
    per value, float32 ~8, so a group the size of a float32 one costs ~4x transient memory)."""
    sizes = [r.embedding.nbytes for r in rows if r.embedding is not None]
    mean = (sum(sizes) / len(sizes)) if sizes else 1
    fmt = embedding_format(schema)
    weight = 4 if fmt.layout == "nested" and fmt.dtype == "float16" else 1
    return max(1, min(1 << 20, int(ROW_GROUP_BYTES // max(mean * weight, 1))))


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cached_pages(fd: int, offset: int = 0, length: int = 0) -> None:
    """Advise the kernel to free the page cache of a written, synced range (``length`` 0: to
    the end): left there, gigabytes of embeddings evict the user's cached files, and fresh
    pages cost more kernel time than pages freed a moment ago (benchmarks/RESULTS.md)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def synced(path: Path, drop_cache: bool = False) -> None:
    """Sync a written file (``drop_cache``: the run will not read it again, so its pages
    leave the cache: ``drop_cached_pages``)."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
        if drop_cache:
            drop_cached_pages(handle.fileno())


def write_atomic(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Write ``data`` (or have ``data(tmp)`` write) a synced file under a hidden temporary
    name, then rename it to ``path``: a reader sees the old file or the new one whole, and a
    failed write leaves nothing."""
    tmp = temp_path(path)
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data)
            synced(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_os_error(path, exc) from None


def _write_synced(table: pa.Table, path: Path, row_group_size: int, drop_cache: bool) -> None:
    write_parquet(table, path, row_group_size)
    synced(path, drop_cache)


def write_table_atomic(table: pa.Table, path: Path, row_group_size: int,
                       drop_cache: bool = False) -> None:
    write_atomic(path, lambda tmp: _write_synced(table, tmp, row_group_size, drop_cache))


def write_part(folder: str | Path, name: str, table: pa.Table, row_group_size: int,
               start: int, end: int, digest: str, *, generation: int = 0,
               drop_cache: bool = False, staged: bool = False) -> dict[str, Any]:
    """Write part ``name``'s file into ``folder`` (a writer thread, a torchrun rank or a ray
    actor does) and return the manifest entry a ``PartStore`` records to commit it. ``staged``:
    the file keeps a hidden temporary name (the entry's ``staged``) until
    ``PartStore.commit_written`` renames it: an unrecorded part never has a part name.
    ``folder`` a URL: the file is uploaded to ``folder/FILE`` whole (never staged)."""
    file = part_file(name, generation)
    entry: dict[str, Any] = {"file": file, "start": start, "end": end, "digest": digest,
                             "rows": table.num_rows, **error_counts(table)}
    try:
        uploaded = storage.upload_written(
            folder, file, lambda tmp: write_parquet(table, tmp, row_group_size))
    except OSError as exc:
        raise store_failure(str(folder), exc) from None
    if uploaded is not None:
        entry["size"] = uploaded
        return entry
    path = Path(folder) / file
    if not staged:
        write_table_atomic(table, path, row_group_size, drop_cache)
        entry["size"] = path.stat().st_size
        return entry
    tmp = temp_path(path)
    try:
        _write_synced(table, tmp, row_group_size, drop_cache)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_os_error(path, exc) from None
    entry["size"] = tmp.stat().st_size
    entry["staged"] = tmp.name
    return entry


def store_failure(url: str, exc: OSError) -> DsvError:
    """The one-line error of a failed call to the store of ``url``: ``storage.StoreDown`` when
    it stopped answering (the run then says where its committed parts are kept)."""
    down = storage.down_error(url, exc)
    return down if down is not None else OutputError(storage.describe(url, exc))


def write_json_atomic(data: Any, path: Path) -> None:
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())


def part_intact(path: Path, rows: int | None) -> bool:
    """A committed part can be reused: its footer reads back with the recorded row count, its
    column chunks' metadata fitting its schema (``check_column_chunks``: else readers refuse
    it, naming --update, or --resume, as its repair)."""
    try:
        if not path.is_file():
            return False
        footer = pq.read_metadata(path)
        check_column_chunks(footer)
        return footer.num_rows == rows
    except Exception:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        return False


def part_kept(part: dict[str, Any], folder: Path,
              stored: "Mapping[str, storage.ObjectInfo]") -> bool:
    """A committed part's bytes are all there: an object of the recorded size in the bucket
    (``stored``: the listed objects by name; each is uploaded whole, before any manifest lists
    it), or a file in ``folder`` whose footer reads back (``part_intact``)."""
    found = stored.get(part["file"])
    if found is not None:
        return found.size == part.get("size")
    return part_intact(folder / part["file"], part.get("rows"))


def manifest_document(settings: dict[str, Any], parts: dict[str, dict[str, Any]],
                      **extra: Any) -> dict:
    """A manifest's content: format tag, the run's settings, the committed parts, ``extra``."""
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "settings": settings,
            "parts": parts, **extra}


def share_entry(table: pa.Table, inputs: Sequence) -> dict[str, str]:
    """A part's manifest entry's ``share`` where its rows are not every input of its range
    (``inputs``, ``headers.Planned``): a --shard-output rank's share, a bit per input, set
    for each input it holds (base64, little-endian bit order). A resumed run's end then knows
    the part's rows (``part_rows``) without reading the part back. Nothing for a part that
    holds every input, or whose rows are not in its inputs' order."""
    if table.num_rows == len(inputs) or not inputs:
        return {}
    at = {utf8_text(p.item.key): i for i, p in enumerate(inputs)}
    held = [at.get(key, -1) for key in table.column("path").to_pylist()]
    if any(i < 0 for i in held) or any(b <= a for a, b in zip(held, held[1:])):
        return {}
    bits = np.zeros(len(inputs), dtype=np.uint8)
    bits[held] = 1
    return {"share": base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode()}


def part_rows(part: dict[str, Any]) -> np.ndarray | None:
    """The inputs that a committed part's rows are, in its file's order (offsets from its
    ``start``): every input of its range, or those its ``share`` names (``share_entry``);
    None for a share that its entry does not record (an earlier dsv4enc's), or records amiss."""
    count = part["end"] - part["start"]
    if "share" not in part:
        return np.arange(count) if part["rows"] == count else None
    try:
        bits = np.frombuffer(base64.b64decode(part["share"], validate=True), dtype=np.uint8)
    except (binascii.Error, TypeError, ValueError):
        return None
    if len(bits) != (count + 7) // 8:
        return None
    held = np.flatnonzero(np.unpackbits(bits, count=count, bitorder="little"))
    return held if len(held) == part["rows"] else None


def names_part_file(part: dict) -> bool:
    """A part committed as its own file (``PartStore``), under a dsv4enc part file name."""
    return isinstance(part.get("file"), str) and bool(PART_FILE.fullmatch(part["file"]))


def is_journal_entry(part: dict) -> bool:
    """A part committed as a byte range of the growing file (``appending.AppendingStore``)."""
    return ("file" not in part and isinstance(part.get("offset"), int)
            and isinstance(part.get("length"), int))


def is_manifest(data: Any) -> bool:
    """``data`` is a manifest of this format, which lists only dsv4enc part names: that makes
    its folder's part files provably dsv4enc's."""
    return (is_dsv4enc_document(data) and isinstance(data.get("parts"), dict)
            and all(isinstance(part, dict) and (names_part_file(part) or is_journal_entry(part))
                    for part in data["parts"].values())
            and data.get("format") == MANIFEST_FORMAT and data.get("version") == MANIFEST_VERSION)


def pre_release_manifest(folder: Path) -> Path | None:
    """A manifest in ``folder`` that a dsv4enc before 0.1.0 wrote (dsv4enc's, of another
    format), or None: such an output is refused, not read."""
    for path in manifest_paths(folder):
        try:
            data = load_manifest(path)
        except (OSError, ValueError):
            continue
        if (is_dsv4enc_document(data)
                and (data.get("format"), data.get("version")) != (MANIFEST_FORMAT, MANIFEST_VERSION)):
            return path
    return None


def read_manifest(path: Path) -> dict | None:
    """The manifest at ``path`` if it is dsv4enc's (``is_manifest``), sane in size; else None."""
    try:
        if not path.is_file() or path.stat().st_size > (256 << 20):
            return None
        data = load_manifest(path)
    except (OSError, ValueError):
        return None
    return data if is_manifest(data) else None


def listed_files(document: dict) -> list[str]:
    """The part files a manifest document lists, and its row stamps file (``update``)."""
    files = [part["file"] for part in document.get("parts", {}).values() if "file" in part]
    stamps = document.get("stamps")
    if isinstance(stamps, dict) and STAMPS_FILE.fullmatch(str(stamps.get("file"))):
        files.append(stamps["file"])
    return files


def listed_names(documents: Iterable[dict]) -> set[str]:
    return {name for document in documents for name in listed_files(document)}


def manifest_paths(folder: Path) -> list[Path]:
    """The manifests' paths in ``folder``, in name order (one, or one per rank)."""
    try:
        names = sorted(entry.name for entry in os.scandir(folder))
    except OSError:
        return []
    return [folder / name for name in names if MANIFEST_FILE.fullmatch(name)]


def read_manifests(folder: Path) -> dict[Path, dict]:
    """The dsv4enc manifests in ``folder``, in name order."""
    found = {path: read_manifest(path) for path in manifest_paths(folder)}
    return {path: data for path, data in found.items() if data is not None}


def error_counts(table: pa.Table) -> dict[str, int]:
    """A part's error rows as its manifest entry counts them: ``failed``, all of them, and
    ``transient``, those whose read may pass later (``images/decode.is_transient``), which
    ``--resume`` encodes again."""
    errors = [error for error in table.column("error").to_pylist() if error is not None]
    return {"failed": len(errors), "transient": sum(1 for e in errors if is_transient(e))}


class PartStore:
    """Parts as closed files in a folder, and the manifest (``manifest_document``) that every
    way of committing parts keeps: the run's ``settings`` (what must match for ``--resume``)
    and, per committed part, its input range, ``digest`` (``KEYS.FILES``: of its keys, then
    of its input files' sizes and times), row count, transient errors, and where its bytes
    are (its ``file``, or a range of ``appending.AppendingStore``'s growing file).
    ``drop_cache``: the parts are the output itself (a local folder), never read back by the
    run, so their pages leave the page cache once synced."""

    def __init__(self, folder: Path, settings: dict[str, Any],
                 manifest_name: str = MANIFEST_NAME, drop_cache: bool = False) -> None:
        self.folder = folder
        self.settings = settings
        self.manifest_name = manifest_name
        self.parts = {}
        self.extra: dict[str, Any] = {}  # more top-level manifest entries (a store's own)
        self.changed = 0  # committed parts whose input files changed (found by ``committed``)
        self._recorded: dict[str, Any] = {"parts": {}}  # the manifest ``load_existing`` read
        self.source: Sequence = ()  # the run's inputs (``headers.Planned``): part digests
        self.commit_seconds: float | None = None  # join segments into parts for this long
        self._lock = threading.RLock()
        self._journal: str | None = None  # the token of the manifest this run wrote whole
        self.drop_cache = drop_cache
        self.generation = 0  # of its part file names (``files.part_file``; ``update``'s: 1 on)
        # ``fetch(file, path)``: a part uploaded to the bucket whole (``commit_written``)
        self.fetch: Callable[[str, Path], None] | None = None
        #: Where ``commit`` writes part files: ``folder``, or the bucket folder of an object
        #: storage folder output (``remote.RemoteOutput.attach``), which stages none of them.
        self.part_folder: str | Path = folder
        #: The committed part files that stay in that bucket folder, not in ``folder``, as
        #: listed, by name (``--resume`` judges them by their sizes, never reads them).
        self.stored: Mapping[str, storage.ObjectInfo] = {}

    @property
    def parts(self) -> dict[str, dict[str, Any]]:
        """The committed parts by name."""
        return self._parts

    @parts.setter
    def parts(self, parts: dict[str, dict[str, Any]]) -> None:
        self._parts = dict(parts)
        self._starts = {part["start"]: name for name, part in self._parts.items()
                        if isinstance(part, dict) and "start" in part}

    def committed_at(self, start: int) -> tuple[str, int] | None:
        """The name and end of the committed part that starts at input ``start`` (any thread)."""
        name = self._starts.get(start)
        part = self._parts.get(name) if name is not None else None
        return (name, part["end"]) if part is not None else None

    @property
    def manifest_path(self) -> Path:
        return self.folder / self.manifest_name

    @property
    def journal_path(self) -> Path:
        return journal_path(self.manifest_path)

    def create(self) -> None:
        """Write the run's first manifest: a full disk now says that nothing was committed."""
        try:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise output_os_error(self.folder, exc) from None
            self.save()
        except OutputError as exc:
            exc.args = (str(exc).replace(PARTS_KEPT, "nothing was committed"),)
            raise

    def load_existing(self) -> dict[str, Any]:
        """Read an earlier run's manifest; returns its settings."""
        try:
            data = load_manifest(self.manifest_path)
        except (OSError, ValueError) as exc:
            raise OutputError(f"cannot resume: unreadable manifest {self.manifest_path} "
                              f"({exc})") from None
        if not is_manifest(data):
            raise OutputError(f"cannot resume: {self.manifest_path} is not a dsv4enc manifest")
        check_parts(data, str(self.manifest_path))
        self._recorded = data
        return data["settings"]

    @property
    def finished(self) -> bool:
        """Whether the manifest ``load_existing`` read is a finished folder's: a run names its
        stamps file there last (``update.write_folder_stamps``)."""
        return "stamps" in self._recorded

    def load_parts(self) -> None:
        """Take the recorded parts whose bytes are still there (after ``load_existing``, once
        the settings were found equal: judging parts can warn and copy)."""
        self.parts = self._intact_parts(self._recorded)

    def _intact_parts(self, data: dict) -> dict[str, dict[str, Any]]:
        """The recorded parts whose bytes are still there, whole (the rest is re-encoded)."""
        return {name: part for name, part in data["parts"].items()
                if names_part_file(part) and part_kept(part, self.folder, self.stored)}

    def committed(self, name: str, start: int, end: int, digest: str) -> bool:
        """Part ``name`` was committed for exactly these inputs, as they are now: the same
        range, keys and input files (size, time, ...), and no row with a transient error.
        Counts in ``changed`` the parts whose keys are the same but whose files changed."""
        part = self.parts.get(name)
        if not part or part["start"] != start or part["end"] != end:
            return False
        if part["digest"] != digest:
            if part["digest"].split(".")[0] == digest.split(".")[0]:
                self.changed += 1
            return False
        return part.get("transient", 0) == 0

    def drop(self, names: Sequence[str]) -> None:
        """Drop recorded parts that are not reused, and their part files, at any time
        (commits may land meanwhile): a folder output must not keep a stale part beside the
        rows that replace it. The manifest stops listing them first (never a gone file): a
        journal line (a drop costs its parts, not the manifest's), or it is written whole."""
        with self._lock:
            gone = [name for name in names if name in self._parts]
            dropped = [self._parts.pop(name) for name in gone]
            for name, part in zip(gone, dropped):
                if self._starts.get(part.get("start")) == name:
                    del self._starts[part["start"]]
            if self._journal is None:
                self.save()
            elif gone:
                self._append(json.dumps({"drop": gone}).encode() + b"\n")
        for part in dropped:
            if names_part_file(part):  # a range of the growing file needs nothing
                (self.folder / part["file"]).unlink(missing_ok=True)

    forget = drop  # once, as a resume starts: a store may put its bytes in order then

    def _record(self, name: str, entry: dict[str, Any]) -> None:
        """Record a committed part: one line appended to the journal and synced (several
        writer threads may call it). A commit costs the same however many came before."""
        with self._lock:
            if self._journal is not None:
                # The images listed so far ride along: ``inspect`` of a killed run says how
                # many are left (the manifest was written whole before the listing ended)
                listed = {"inputs": self.extra["inputs"]} if "inputs" in self.extra else {}
                line = json.dumps({"name": name, "part": entry, **listed}, sort_keys=True) + "\n"
                self._append(line.encode())
            self._parts[name] = entry  # in place: a copy would cost O(parts) per commit
            self._starts[entry["start"]] = name
            if self._journal is None:  # no manifest of this run's yet
                self.save()

    def _append(self, line: bytes) -> None:
        """Append a line to the journal (its header first when it is new) and sync it; a
        failed write is cut off again, so that the journal ends with a whole line."""
        path = self.journal_path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise output_os_error(path, exc) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                line = json.dumps({"format": JOURNAL_FORMAT, "manifest": self._journal},
                                  sort_keys=True).encode() + b"\n" + line
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, size)
                raise output_os_error(path, exc) from None
        finally:
            os.close(fd)
        if size == 0:
            fsync_dir(self.folder)

    def save(self) -> None:
        """Write the manifest whole (every committed part) under a new journal token, then
        drop the journal it replaces: a crash between leaves a journal no manifest names."""
        with self._lock:
            token = secrets.token_hex(8)
            write_json_atomic(manifest_document(self.settings, self.parts, journal=token,
                                                **self.extra), self.manifest_path)
            self._journal = token
            try:
                self.journal_path.unlink(missing_ok=True)
            except OSError as exc:
                raise output_os_error(self.journal_path, exc) from None

    def compact(self) -> None:
        """Fold the journal into the manifest once commits are over: a finished output is one
        manifest."""
        if self._journal is not None and self.journal_path.exists():
            self.save()

    def commit(self, name: str, table: pa.Table, row_group_size: int, start: int, end: int,
               digest: str) -> None:
        """Write one part to ``part_folder`` (writer threads commit at once); a rank's share of
        its range records which inputs it holds (``share_entry``)."""
        entry = write_part(self.part_folder, name, table, row_group_size, start, end, digest,
                           generation=self.generation, drop_cache=self.drop_cache)
        self.commit_written(name, {**entry, **share_entry(table, self.source[start:end])})

    def commit_written(self, name: str, entry: dict[str, Any]) -> None:
        """Commit part ``name``, whose file ``write_part`` wrote (here, on another rank or in
        an actor; ``entry``: what it returned): a staged file is renamed into place, one in a
        bucket is handed to ``fetch`` (``remote.RemoteOutput.adopt_part``), then the manifest
        records it."""
        entry = dict(entry)
        staged = entry.pop("staged", None)
        path = self.folder / entry["file"]
        try:
            if staged is not None:
                os.replace(self.folder / staged, path)
                fsync_dir(self.folder)
            elif self.fetch is not None:
                self.fetch(entry["file"], path)
        except FileNotFoundError:
            raise OutputError(f"the part file {entry['file']} was written where this process "
                              f"cannot see it: give --out a folder that every node shares, "
                              "or a bucket") from None
        except OSError as exc:
            raise output_os_error(path, exc) from None
        self._record(name, entry)

    def adopt(self, name: str, entry: dict[str, Any]) -> None:
        """Record a part whose file is already where the output keeps it (``update``)."""
        self._record(name, entry)


class StreamingAssembler:
    """Builds the single output file from committed parts in input order while later parts
    are still encoded, so a run's end only closes the file: each commit (``notify``, on the
    writer's thread) copies in the parts that now continue the file, their row groups as
    they are (``parquet_join.ParquetJoiner``: no second encode), into a hidden temporary in
    the parts folder; ``finish`` writes its footer, syncs and renames it."""

    def __init__(self, store: "PartStore", out: Path, schema: pa.Schema) -> None:
        self.store, self.out, self.schema = store, out, schema
        self.key_values: dict[bytes, bytes] = {}  # more footer metadata (its rows' stamps)
        self.tmp = temp_path(out, store.folder)
        self._error: OutputError | None = None  # a failed copy, raised by ``finish``
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self._position = 0  # where the parts copied so far end
        self._copied: list[tuple[str, dict]] = []  # their names and manifest entries
        try:  # None once a part cannot be joined: ``finish`` encodes the parts again
            self._joiner: ParquetJoiner | None = ParquetJoiner(self.tmp)
        except OSError as exc:
            raise output_os_error(self.out, exc) from None

    def notify(self) -> None:
        """A part was committed: copy in the parts that now continue the file."""
        with self._lock:
            while (self._joiner is not None
                   and (committed := self.store.committed_at(self._position)) is not None):
                name, end = committed
                entry = self.store.parts[name]
                try:
                    self._joiner.append(self.store.folder / entry["file"])
                    self._copied.append((name, entry))
                except (JoinError, OSError) as exc:  # the parts stay committed: told by finish
                    self._joiner.abort()
                    self._joiner = None
                    if isinstance(exc, JoinError):
                        log.warning("encoding the parts into %s again: %s", self.out, exc)
                    else:
                        self._error = output_os_error(self.out, exc)
                self._position = end

    def _encode_again(self) -> None:
        """Parts that cannot be joined by copying (e.g. another pyarrow's), or none: read each
        back and encode it into a new file, the footer's metadata in its schema."""
        schema = self.schema.with_metadata({**(self.schema.metadata or {}), **self.key_values})
        with pq.ParquetWriter(self.tmp, schema, **parquet_options(schema)) as writer:
            position = 0
            while (committed := self.store.committed_at(position)) is not None:
                name, position = committed
                handle = pq.ParquetFile(self.store.folder / self.store.parts[name]["file"])
                for group in range(handle.num_row_groups):
                    writer.write_table(handle.read_row_group(group).replace_schema_metadata(
                        schema.metadata))
        synced(self.tmp)

    def finish(self) -> None:
        """Copy in what is left, write the footer (``key_values`` are final now), and move the
        file into place (or raise the failed write)."""
        try:
            self.notify()
            if any(self.store.parts.get(name) is not entry for name, entry in self._copied):
                self.abort()  # a part copied in was dropped since (its inputs changed): anew
                self._start()
                self.notify()
            if self._error is not None:
                raise self._error
            if self._joiner is not None and self._joiner.schema is not None:
                self._joiner.close(self.key_values)
            else:
                self.abort()
                self._encode_again()
            os.replace(self.tmp, self.out)
            fsync_dir(self.out.parent)
        except OSError as exc:
            raise output_os_error(self.out, exc) from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop without producing ``out`` (interrupted or failed run)."""
        with self._lock:
            if self._joiner is not None:
                self._joiner.abort()
                self._joiner = None
        self.tmp.unlink(missing_ok=True)
