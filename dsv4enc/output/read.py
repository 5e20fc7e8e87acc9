"""Reading dsv4enc output back: ``read_embeddings`` streams rows as numpy arrays.

Works on a single Parquet file and on a dataset folder of part files (in input order when the
folder has dsv4enc's ``_manifest.json``, else in sorted file order). Only a few rows are in
memory at a time; values come back exactly as stored (float16 stays float16)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..errors import UsageError

#: The manifest of a folder of parts (per rank under --shard-output: ``_manifest-rankNNN.json``).
MANIFEST_NAME = "_manifest.json"
#: What a manifest's journal starts with (docs/output-format.md#the-manifest-and-its-journal).
JOURNAL_FORMAT = "dsv4enc-journal"

#: Rows per Arrow batch while streaming, at most (a row of the full model is up to ~3 MB in
#: float16: fewer of those, by ``BATCH_BYTES``).
BATCH_ROWS = 16


def output_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files of an output: the file itself, or a folder's part files in order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UsageError(f"no such file or folder: {path}")
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        try:
            files = part_files(path, load_manifest(manifest).get("parts", {}).values())
            listed = set(files)  # rank manifests (before the merge) may list more parts
            return files + [f for f in _parquet_under(path) if f not in listed]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return _parquet_under(path)


def part_files(folder: Path, parts: Iterable[dict]) -> list[Path]:
    """The files of manifest ``parts`` that are in ``folder``, in input order."""
    ordered = sorted(parts, key=lambda p: (p["start"], p["file"]))
    return [folder / p["file"] for p in ordered if (folder / p["file"]).is_file()]


def journal_path(manifest: Path) -> Path:
    """The journal beside a manifest: ``_manifest.json`` -> ``_manifest.journal``."""
    return manifest.with_suffix(".journal")


def load_manifest(path: Path) -> Any:
    """A manifest's JSON with the parts its journal committed since it was last written whole
    (raises OSError, ValueError); every reader of the committed parts goes through here. A run
    appends one synced line per part to the journal, so a commit costs the same at part 10 and
    10^5; the journal applies when its header names the manifest's ``journal`` token."""
    data = json.loads(path.read_text())
    if (isinstance(data, dict) and isinstance(data.get("parts"), dict)
            and isinstance(data.get("journal"), str)):
        data["parts"].update(journal_entries(journal_path(path), data["journal"]))
    return data


def journal_entries(path: Path, token: str) -> Iterator[tuple[str, dict]]:
    """``(name, part)`` per whole line of the journal at ``path``, in commit order, if its header
    names ``token`` (else nothing); a last line without its newline is a torn write, ignored."""
    try:
        handle = open(path, "rb")
    except OSError:
        return
    with handle:
        for number, line in enumerate(handle):
            if not line.endswith(b"\n"):
                return  # torn: the write of the last commit did not finish
            try:
                entry = json.loads(line)
            except ValueError:
                return
            if not isinstance(entry, dict):
                return
            if number == 0:
                if entry.get("format") != JOURNAL_FORMAT or entry.get("manifest") != token:
                    return
                continue
            if not (isinstance(entry.get("name"), str) and isinstance(entry.get("part"), dict)):
                return
            yield entry["name"], entry["part"]


def _parquet_under(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        found.extend(Path(root) / f for f in sorted(files)
                     if f.endswith(".parquet") and not f.startswith((".", "_")))
    return found


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


def embedding_format(schema) -> EmbeddingFormat:
    """The ``embedding`` column's format, from an output's Arrow schema and its ``dsv4enc``
    metadata (which names the layout; outputs written before it did are ``nested``)."""
    import pyarrow as pa

    kind = schema.field("embedding").type
    described = _metadata_of(schema).get("embedding")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        if not isinstance(described, dict):
            raise UsageError("binary embedding column without dsv4enc metadata naming its "
                             "dtype and width")
        return EmbeddingFormat("binary", str(described["dtype"]), int(described["width"]),
                               bool(described.get("pooled", False)))
    pooled = pa.types.is_fixed_size_list(kind)
    row = kind if pooled else kind.value_type
    if not pa.types.is_fixed_size_list(row) or not pa.types.is_floating(row.value_type):
        raise UsageError(f"unknown embedding column type {kind}")
    return EmbeddingFormat("nested", _FLOAT_NAMES[str(row.value_type)], row.list_size, pooled)


def _metadata_of(schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(b"dsv4enc")
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
                    copy: bool = True) -> Iterator[Any]:
    """Stream the rows of a dsv4enc output (a Parquet file or a dataset folder).

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
    import pyarrow.parquet as pq

    if errors not in ("skip", "include"):
        raise ValueError(f"errors must be 'skip' or 'include', not {errors!r}")
    wanted = list(columns) if columns is not None else None
    need = (wanted or ["path", "grid_h", "grid_w", "embedding"]).copy()
    if errors == "skip" and "error" not in need:
        need.append("error")
    for file in output_files(path):
        handle = pq.ParquetFile(file, memory_map=True)
        names = handle.schema_arrow.names
        unknown = [c for c in need if c not in names]
        if unknown:
            raise UsageError(f"{file}: no column {unknown[0]!r} (columns: {', '.join(names)})")
        fmt = embedding_format(handle.schema_arrow) if "embedding" in need else None
        rows = batch_rows or _rows_per_batch(handle, "embedding" in need, copy)
        for batch in handle.iter_batches(batch_size=rows, columns=need):
            yield from _batch_rows(batch, need, wanted, fmt, errors == "skip", copy)


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


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``dsv4enc`` metadata of an output (its first file's), or {} if there is none."""
    import pyarrow.parquet as pq

    files = output_files(path)
    if not files:
        return {}
    return _metadata_of(pq.read_schema(files[0]))
