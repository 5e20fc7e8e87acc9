"""Images inside container files: Parquet/Arrow tables with an image column, and WebDataset
tar shards.

The main process reads only an index of each container (a tar's member headers; a table's
row-group sizes and key column) and turns every image into an ``InputItem`` whose ``member``
says where its bytes lie. Decode workers then read just that member: a tar member by offset
and size, a table cell by row group (or record batch) and row, through a small per-process
cache of recently read row groups. Locators are small frozen dataclasses, cheap to pickle to
the workers.

Tar shards follow the WebDataset convention: a member ``dir/sample.jpg`` belongs to the sample
``__key__`` ``dir/sample`` (the member path up to the first dot of its file name) and that key
is the output ``path``. When one sample holds several images (``s.jpg`` and ``s.png``, or
``s.left.jpg`` and ``s.right.jpg``), each is keyed by its full member name instead, so keys
stay unique. Compressed tars cannot be read member by member and are refused.

Table rows are keyed by ``--key-column`` when given; else by the ``path`` field of a
Hugging Face ``{bytes, path}`` image struct when it is set; else ``<file>#<row>`` (the file as
given, the row counted from 0 over the whole file).
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO

from .errors import UsageError

if TYPE_CHECKING:
    import pyarrow as pa

    from .inputs import InputItem

TABLE_EXTENSIONS = (".parquet", ".arrow", ".feather")
TAR_EXTENSIONS = (".tar",)

#: Bytes of row-group columns a process keeps cached (at least the last one read is kept).
CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class TarMember:
    """An image inside a tar shard: the member's name, and where its data lies in the file."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class TableCell:
    """An image in a table: ``column``'s cell at ``row`` of row group (Parquet) or record
    batch (Arrow) ``group``."""

    column: str
    group: int
    row: int


def container_kind(path: str) -> str | None:
    """``"table"``, ``"tar"`` or None, from the file name's extension."""
    lower = path.lower()
    if lower.endswith(TABLE_EXTENSIONS):
        return "table"
    if lower.endswith(TAR_EXTENSIONS):
        return "tar"
    return None


def expand_container(raw: str, image_column: str | None = None,
                     key_column: str | None = None) -> tuple[list["InputItem"], int]:
    """The images in a container file, in file order, and how many entries were passed over
    (tar samples without an image)."""
    kind = container_kind(raw)
    if kind == "tar":
        return expand_tar(raw)
    if kind == "table":
        return expand_table(raw, image_column, key_column), 0
    raise UsageError(f"{raw}: not a container file (.parquet, .arrow, .feather or .tar)")


# ----------------------------------------------------------------------------- tar shards

def split_key(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name into ``(__key__, extension)``: the extension
    starts at the first dot of the file name (``a/b.seg.png`` -> ``("a/b", "seg.png")``)."""
    path = PurePosixPath(name)
    stem, dot, ext = path.name.partition(".")
    parent = str(path.parent)
    key = stem if parent in ("", ".") else f"{parent}/{stem}"
    return key, ext if dot else ""


def expand_tar(raw: str) -> tuple[list["InputItem"], int]:
    """Index an uncompressed tar shard: its image members (by extension), keyed by sample."""
    from .inputs import InputItem, is_image_name

    try:
        archive = tarfile.open(raw, mode="r:")
    except tarfile.ReadError as exc:
        raise UsageError(f"{raw}: not an uncompressed tar file ({exc}); compressed shards "
                         "cannot be read member by member, decompress them first") from None
    except OSError as exc:
        raise UsageError(f"cannot read {raw}: {exc.strerror or exc}") from None
    images: list[tuple[str, TarMember]] = []
    keys_seen: dict[str, int] = {}
    other_keys: set[str] = set()
    with archive:
        try:
            for info in archive:
                if not info.isreg():
                    continue
                base = PurePosixPath(info.name).name
                key, _ = split_key(info.name)
                if base.startswith(".") or not key:
                    continue
                if is_image_name(base):
                    images.append((key, TarMember(info.name, info.offset_data, info.size)))
                    keys_seen[key] = keys_seen.get(key, 0) + 1
                else:
                    other_keys.add(key)
        except tarfile.TarError as exc:
            raise UsageError(f"{raw}: damaged tar file ({exc})") from None
    items = [InputItem(key=key if keys_seen[key] == 1 else member.name, path=raw, member=member)
             for key, member in images]
    return items, len(other_keys - keys_seen.keys())


class _MemberFile(io.RawIOBase):
    """A read-only file over one tar member's bytes (for header probes: PIL reads only as
    much of it as it needs)."""

    def __init__(self, path: str, member: TarMember) -> None:
        self._file = open(path, "rb")
        self._start, self._size, self._pos = member.offset, member.size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        if n == 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def read_tar_member(path: str, member: TarMember) -> bytes:
    """The member's bytes, read by offset and size (no tar parsing)."""
    with open(path, "rb") as handle:
        handle.seek(member.offset)
        data = handle.read(member.size)
    if len(data) != member.size:
        raise EOFError(f"tar member {member.name} is truncated ({len(data)} of "
                       f"{member.size} bytes)")
    return data


# ----------------------------------------------------------------------------- tables

def image_column_kind(dtype: "pa.DataType") -> str | None:
    """``"bytes"`` for a binary column, ``"struct"`` for a ``{bytes, path}`` struct."""
    import pyarrow as pa

    def is_binary(t) -> bool:
        return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(t)))

    if is_binary(dtype):
        return "bytes"
    if pa.types.is_struct(dtype):
        index = dtype.get_field_index("bytes")
        if index >= 0 and is_binary(dtype.field(index).type):
            return "struct"
    return None


def choose_image_column(schema: "pa.Schema", wanted: str | None, source: str) -> str:
    """The image column: ``wanted`` (checked), else the only bytes-like column, else one named
    ``image``."""
    names = schema.names
    if wanted is not None:
        if wanted not in names:
            raise UsageError(f"{source}: no column {wanted!r} (columns: {', '.join(names)})")
        if image_column_kind(schema.field(wanted).type) is None:
            raise UsageError(f"{source}: column {wanted!r} is {schema.field(wanted).type}, "
                             "not image bytes or a {bytes, path} struct")
        return wanted
    candidates = [n for n in names if image_column_kind(schema.field(n).type) is not None]
    if len(candidates) == 1:
        return candidates[0]
    if "image" in candidates:
        return "image"
    if not candidates:
        raise UsageError(f"{source}: no column holds image bytes (columns: {', '.join(names)}); "
                         "pass --image-column")
    raise UsageError(f"{source}: several columns hold bytes ({', '.join(candidates)}); "
                     "choose one with --image-column")


class _Table:
    """Read access to a Parquet file or an Arrow IPC file/stream, group by group."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        self.parquet = path.lower().endswith(".parquet")
        if self.parquet:
            self._file = pq.ParquetFile(path, memory_map=True)
            self.schema = self._file.schema_arrow
            meta = self._file.metadata
            self.group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        else:
            source = pa.memory_map(path, "r")
            try:
                reader = pa.ipc.open_file(source)
                self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                self.schema = reader.schema
            except pa.ArrowInvalid:
                # Hugging Face `datasets` caches are IPC streams; read zero-copy from the map.
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                self._batches = list(reader)
                self.schema = reader.schema
            self.group_rows = [b.num_rows for b in self._batches]

    def read(self, group: int, columns: list[str]) -> "pa.Table":
        import pyarrow as pa

        if self.parquet:
            return self._file.read_row_group(group, columns=columns)
        return pa.Table.from_batches([self._batches[group]]).select(columns)


def _open_table(raw: str) -> _Table:
    import pyarrow as pa

    try:
        return _Table(raw)
    except (OSError, pa.ArrowException) as exc:
        raise UsageError(f"cannot read {raw} as a table: {exc}") from None


def expand_table(raw: str, image_column: str | None = None,
                 key_column: str | None = None) -> list["InputItem"]:
    """One item per row of a Parquet/Arrow file (only the key column is read here)."""
    from .inputs import InputItem

    table = _open_table(raw)
    column = choose_image_column(table.schema, image_column, raw)
    if key_column is not None and key_column not in table.schema.names:
        raise UsageError(f"{raw}: no key column {key_column!r} "
                         f"(columns: {', '.join(table.schema.names)})")
    struct = image_column_kind(table.schema.field(column).type) == "struct"
    has_path = struct and table.schema.field(column).type.get_field_index("path") >= 0
    items: list[InputItem] = []
    row_number = 0
    for group, n_rows in enumerate(table.group_rows):
        keys: list[Any] = [None] * n_rows
        if key_column is not None:
            keys = table.read(group, [key_column]).column(0).to_pylist()
        elif has_path:  # Parquet reads just the struct's path field
            wanted = f"{column}.path" if table.parquet else column
            paths = table.read(group, [wanted]).column(0).combine_chunks()
            keys = paths.field("path").to_pylist()
        for row in range(n_rows):
            key = keys[row]
            if isinstance(key, bytes):
                key = key.decode("utf-8", "replace")
            name = f"{raw}#{row_number}" if key is None or key == "" else str(key)
            items.append(InputItem(key=name, path=raw, member=TableCell(column, group, row)))
            row_number += 1
    return items


class _GroupCache:
    """Recently read row-group columns of this process, least recently used dropped first."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._columns: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self._bytes = 0

    def column(self, path: str, group: int, column: str):
        key = (path, group, column)
        with self._lock:
            if key in self._columns:
                self._columns.move_to_end(key)
                return self._columns[key]
            table = self._tables.get(path)
            if table is None:
                if len(self._tables) >= 16:
                    self._tables.pop(next(iter(self._tables)))
                table = self._tables[path] = _Table(path)
            array = table.read(group, [column]).column(0).combine_chunks()
            self._columns[key] = array
            self._bytes += array.nbytes
            while self._bytes > self.max_bytes and len(self._columns) > 1:
                _, dropped = self._columns.popitem(last=False)
                self._bytes -= dropped.nbytes
            return array

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._columns.clear()
            self._bytes = 0


_CACHE = _GroupCache()


def clear_cache() -> None:
    """Drop this process's cached row groups (the main process, once headers are read)."""
    _CACHE.clear()


def read_table_cell(path: str, cell: TableCell) -> bytes | str:
    """A table cell's image: its bytes, or (a struct with only a path) the file it names."""
    array = _CACHE.column(path, cell.group, cell.column)
    value = array[cell.row]
    if not value.is_valid:
        raise ValueError(f"row has no image (null {cell.column!r})")
    if image_column_kind(array.type) == "bytes":
        return value.as_py()
    data = value["bytes"]
    if data.is_valid:
        return data.as_py()
    named = value["path"].as_py() if array.type.get_field_index("path") >= 0 else None
    if not named:
        raise ValueError(f"row has no image ({cell.column!r} holds neither bytes nor a path)")
    if not os.path.isabs(named) and not os.path.exists(named):
        beside = Path(path).parent / named
        if beside.exists():
            return str(beside)
    return named


# ----------------------------------------------------------------------------- reading items

def open_item(item: "InputItem", stream: bool = False) -> str | bytes | BinaryIO:
    """What to decode for ``item``: a file path, the bytes of a container member, or (with
    ``stream``, for tar members) a file object over the member that the caller closes."""
    member = getattr(item, "member", None)
    if member is None:
        return item.path
    if isinstance(member, TarMember):
        if stream:
            return io.BufferedReader(_MemberFile(item.path, member), buffer_size=64 << 10)
        return read_tar_member(item.path, member)
    if isinstance(member, TableCell):
        return read_table_cell(item.path, member)
    raise TypeError(f"unknown member locator {member!r}")
