"""Join Parquet files of one schema into one file by copying their bytes: no decode, no encode.

A Parquet file is ``PAR1``, its row groups' column chunks, a footer (Thrift compact
FileMetaData), its length and ``PAR1``. The joined file holds the inputs' column chunks as they
are and one footer listing their row groups, offsets moved to where the bytes landed, written
with a small generic Thrift compact codec (pyarrow cannot append row groups). Files with page
indexes or bloom filters (offsets outside the footer) are refused."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"PAR1"

# Thrift compact protocol type ids.
(T_STOP, T_TRUE, T_FALSE, T_BYTE, T_I16, T_I32, T_I64, T_DOUBLE, T_BINARY, T_LIST, T_SET, T_MAP,
 T_STRUCT) = range(13)

# Field ids of parquet.thrift that hold file offsets or need joining.
FILE_NUM_ROWS, FILE_ROW_GROUPS, FILE_KEY_VALUES = 3, 4, 5
GROUP_COLUMNS, GROUP_NUM_ROWS, GROUP_FILE_OFFSET, GROUP_ORDINAL = 1, 3, 5, 7
CHUNK_FILE_OFFSET, CHUNK_META = 2, 3
CHUNK_INDEX_FIELDS = (4, 5, 6, 7)  # offset/column index offsets and lengths
META_SIZE, META_DATA_PAGE, META_DICTIONARY_PAGE = 7, 9, 11  # total_compressed_size, offsets
META_OFFSETS = (9, 10, 11)  # data, index and dictionary page offsets
META_BLOOM = (14, 15)


class JoinError(ValueError):
    """A file that cannot be joined by copying (damaged, another schema, page indexes)."""


class CompactReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        if len(out) != n:
            raise JoinError("truncated Parquet footer")
        self.pos += n
        return out

    def value(self, kind: int) -> Any:
        if kind in (T_TRUE, T_FALSE):  # a bool field's value is its type
            return kind == T_TRUE
        if kind in (T_LIST, T_SET):
            size, element = divmod(self.byte(), 16)
            if size == 15:
                size = self.varint()
            each = T_BYTE if element in (T_TRUE, T_FALSE) else element  # bools: a byte each
            return element, [self.value(each) for _ in range(size)]
        if kind == T_MAP:
            size = self.varint()
            if not size:
                return 0, 0, []
            key, val = divmod(self.byte(), 16)
            return key, val, [(self.value(key), self.value(val)) for _ in range(size)]
        if kind not in self.READ:
            raise JoinError(f"unknown Thrift type {kind} in a Parquet footer")
        return self.READ[kind](self)

    def struct(self) -> list[list]:
        """A struct as ``[[field_id, type, value], ...]`` in stored order."""
        fields, last = [], 0
        while True:
            delta, kind = divmod(self.byte(), 16)
            if kind == T_STOP:
                return fields
            field = last + delta if delta else self.zigzag()
            fields.append([field, kind, self.value(kind)])
            last = field

    #: How each Thrift type of a fixed shape is read.
    READ = {T_BYTE: byte, T_I16: zigzag, T_I32: zigzag, T_I64: zigzag,
            T_DOUBLE: lambda self: self.take(8), T_BINARY: lambda self: self.take(self.varint()),
            T_STRUCT: struct}


class CompactWriter:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while n > 0x7F:
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7
        self.out.append(n)

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, kind: int, value: Any) -> None:
        if kind in (T_LIST, T_SET):
            element, items = value
            self.out.append((min(len(items), 15) << 4) | element)
            if len(items) >= 15:
                self.varint(len(items))
            each = T_BYTE if element in (T_TRUE, T_FALSE) else element  # bools: a byte each
            for item in items:
                self.value(each, item)
        elif kind == T_MAP:
            key, val, items = value
            self.varint(len(items))
            if items:
                self.out.append((key << 4) | val)
                for k, v in items:
                    self.value(key, k)
                    self.value(val, v)
        elif kind not in self.WRITE:
            raise JoinError(f"unknown Thrift type {kind}")
        else:
            self.WRITE[kind](self, value)

    def binary(self, value: bytes) -> None:
        self.varint(len(value))
        self.out += value

    def struct(self, fields: list[list]) -> None:
        last = 0
        for field, kind, value in fields:
            if kind in (T_TRUE, T_FALSE):
                kind = T_TRUE if value else T_FALSE
            delta = field - last
            if 0 < delta <= 15:
                self.out.append((delta << 4) | kind)
            else:
                self.out.append(kind)
                self.zigzag(field)
            self.value(kind, value)
            last = field
        self.out.append(T_STOP)

    #: How each Thrift type of a fixed shape is written (a bool field's value is its type).
    WRITE = {T_TRUE: lambda self, value: None, T_FALSE: lambda self, value: None,
             T_BYTE: lambda self, value: self.out.append(value), T_I16: zigzag, T_I32: zigzag,
             T_I64: zigzag, T_DOUBLE: lambda self, value: self.out.extend(value), T_BINARY: binary,
             T_STRUCT: struct}



def _value(fields: list[list], field: int, default: Any = None) -> Any:
    return next((f[2] for f in fields if f[0] == field), default)


def row_groups(footer: list[list]) -> list[list]:
    """The row groups a decoded footer lists."""
    return _value(footer, FILE_ROW_GROUPS, (T_STRUCT, []))[1]


def footer_bytes(footer: list[list]) -> bytes:
    """A file's closing bytes: ``footer`` encoded, its length and ``PAR1``."""
    writer = CompactWriter()
    writer.struct(footer)
    return bytes(writer.out) + struct.pack("<I", len(writer.out)) + MAGIC


def read_footer(handle: BinaryIO, size: int) -> tuple[list[list], int]:
    """A Parquet file's decoded FileMetaData and where its footer starts."""
    if size < 12:
        raise JoinError("not a Parquet file (too short)")
    handle.seek(size - 8)
    tail = handle.read(8)
    length = struct.unpack("<I", tail[:4])[0]
    start = size - 8 - length
    if tail[4:] != MAGIC or start < 4:
        raise JoinError("not a Parquet file (no footer)")
    handle.seek(0)
    if handle.read(4) != MAGIC:
        raise JoinError("not a Parquet file (no leading magic)")
    handle.seek(start)
    return CompactReader(handle.read(length)).struct(), start


def move_group(group: list[list], shift: int, ordinal: int) -> None:
    """Shift a row group's byte offsets by ``shift`` and give it its new ordinal."""
    for field in group:
        if field[0] == GROUP_FILE_OFFSET:
            field[2] += shift
        elif field[0] == GROUP_ORDINAL:
            field[2] = ordinal
    for chunk in _value(group, GROUP_COLUMNS)[1]:
        for field in chunk:
            if field[0] in CHUNK_INDEX_FIELDS:
                raise JoinError("a file with page indexes cannot be joined by copying")
            if field[0] == CHUNK_FILE_OFFSET and field[2]:
                field[2] += shift
            elif field[0] == CHUNK_META:
                for meta in field[2]:
                    if meta[0] in META_BLOOM:
                        raise JoinError("a file with bloom filters cannot be joined by copying")
                    if meta[0] in META_OFFSETS:
                        meta[2] += shift


def group_span(group: list[list]) -> tuple[int, int]:
    """Where a row group's column chunks lie in its file: (first byte, end)."""
    spans = []
    for chunk in _value(group, GROUP_COLUMNS)[1]:
        meta = {field[0]: field[2] for field in _value(chunk, CHUNK_META)}
        start = min(meta[k] for k in (META_DATA_PAGE, META_DICTIONARY_PAGE) if meta.get(k))
        spans.append((start, start + meta[META_SIZE]))
    return min(start for start, _ in spans), max(end for _, end in spans)


def with_key_values(footer: list[list], entries: dict[bytes, bytes] | None) -> list[list]:
    """``footer`` with ``entries`` added to (or replacing keys of) its key-value metadata."""
    if not entries:
        return footer
    old = _value(footer, FILE_KEY_VALUES, (T_STRUCT, []))[1]
    pairs = [kv for kv in old if _value(kv, 1, b"") not in entries]
    pairs += [[[1, T_BINARY, key], [2, T_BINARY, value]] for key, value in entries.items()]
    fields = [f for f in footer if f[0] != FILE_KEY_VALUES]
    return sorted(fields + [[FILE_KEY_VALUES, T_LIST, (T_STRUCT, pairs)]], key=lambda f: f[0])


def schema_part(footer: list[list]) -> list[list]:
    """What must agree between joined files: everything but the row groups and row count."""
    return [f for f in footer if f[0] not in (FILE_NUM_ROWS, FILE_ROW_GROUPS)]


def whole_footer(schema: list[list], groups: list[list], rows: int) -> list[list]:
    """A FileMetaData of ``schema`` (a footer's ``schema_part``) listing ``groups``."""
    fields = schema + [[FILE_NUM_ROWS, T_I64, rows], [FILE_ROW_GROUPS, T_LIST, (T_STRUCT, groups)]]
    return sorted(fields, key=lambda field: field[0])


def copy_range(source: BinaryIO, target: BinaryIO, offset: int, count: int) -> None:
    """Append ``count`` bytes at ``offset`` of ``source`` to ``target``: in the kernel where it
    can (``copy_file_range``: a reflink where the file system shares extents), else by hand."""
    target.flush()
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < count:
                n = os.copy_file_range(source.fileno(), target.fileno(), count - done,
                                       offset + done)
                if n == 0:
                    break
                done += n
        except OSError:
            pass  # e.g. not supported between these files: copy the rest by hand
    target.seek(0, os.SEEK_END)
    source.seek(offset + done)
    left = count - done
    while left > 0:
        block = source.read(min(left, 8 << 20))
        if not block:
            raise JoinError("a file ended early")
        target.write(block)
        left -= len(block)


class ParquetJoiner:
    """Writes one Parquet file of whole files of one schema and key-value metadata appended
    in turn (``append``), then its footer (``close``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._out = open(self.path, "wb")
        self._out.write(MAGIC)
        self._footer: list[list] | None = None
        self._groups: list[list] = []
        self._rows = 0

    def append(self, path: Path) -> None:
        """Copy ``path``'s row groups (their bytes, as they are) to the end of the file."""
        with open(path, "rb") as source:
            footer, start = read_footer(source, os.fstat(source.fileno()).st_size)
            if self._footer is None:
                self._footer = footer
            elif schema_part(footer) != schema_part(self._footer):
                raise JoinError(f"{path} has another schema or metadata than the first file")
            shift = self._out.tell() - 4
            for group in row_groups(footer):
                move_group(group, shift, len(self._groups))
                self._groups.append(group)
            self._rows += _value(footer, FILE_NUM_ROWS, 0)
            copy_range(source, self._out, 4, start - 4)

    def close(self, key_values: dict[bytes, bytes] | None = None) -> None:
        """Write the joined footer, with ``key_values`` added, and close the file."""
        if self._footer is None:
            self._out.close()
            raise JoinError("no file to join")
        footer = whole_footer(schema_part(self._footer), self._groups, self._rows)
        self._out.write(footer_bytes(with_key_values(footer, key_values)))
        self._out.close()

    def abort(self) -> None:
        self._out.close()
