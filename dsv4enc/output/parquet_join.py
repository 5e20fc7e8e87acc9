"""Join Parquet files of one schema into one file by copying their bytes: no decode, no encode.

A Parquet file is ``PAR1``, its row groups' column chunks, a footer (Thrift compact
FileMetaData), its length and ``PAR1``. The joined file holds the inputs' column chunks as they
are and one footer listing their row groups, offsets moved to where the bytes landed, written
with a small generic Thrift compact codec (pyarrow cannot append row groups). Files with page
indexes or bloom filters (offsets outside the footer) are refused."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
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
META_SIZE_STATISTICS = 16  # its level histograms (SizeStatistics: 1, 2, 3)


class JoinError(ValueError):
    """A file that cannot be joined by copying (damaged, another schema, page indexes)."""


class CompactReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise JoinError("truncated Parquet footer")
        self.pos += 1
        return self.data[self.pos - 1]

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
            key_read, val_read = (T_BYTE if kind in (T_TRUE, T_FALSE) else kind
                                  for kind in (key, val))  # bools: a byte each, as in lists
            return key, val, [(self.value(key_read), self.value(val_read))
                              for _ in range(size)]
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
        elif kind == T_STRUCT and isinstance(value, bytes):  # encoded already (``encoded``)
            self.out += value
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


def encoded(fields: list[list]) -> bytes:
    """A decoded struct's Thrift compact bytes: a tenth to a fortieth of the memory the decoded
    lists take (a writer takes them in place of the struct)."""
    writer = CompactWriter()
    writer.struct(fields)
    return bytes(writer.out)


#: A part's row groups, each ``encoded``, and its row count: what a joined file's footer
#: takes of the part's (the rest, its schema and key-value metadata, every part shares).
PackedGroups = tuple[list[bytes], int]


def packed_groups(footer: list[list]) -> PackedGroups:
    """``footer``'s ``PackedGroups``."""
    return [encoded(group) for group in row_groups(footer)], _value(footer, FILE_NUM_ROWS, 0)


def footer_bytes(footer: list[list]) -> bytes:
    """A file's closing bytes: ``footer`` encoded, its length and ``PAR1``."""
    data = encoded(footer)
    return data + struct.pack("<I", len(data)) + MAGIC


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
    try:
        return CompactReader(handle.read(length)).struct(), start
    except RecursionError:  # structs nested past Python's stack: no Parquet writer does that
        raise JoinError("damaged Parquet footer (nested too deep)") from None


def joinable_footer(path: Path) -> tuple[list[list], int]:
    """``read_footer`` of the file at ``path``, whose row groups can be moved: no page
    indexes or bloom filters, whose offsets lie outside (else ``JoinError``)."""
    with open(path, "rb") as source:
        footer, start = read_footer(source, os.fstat(source.fileno()).st_size)
    for group in row_groups(footer):
        move_group(group, 0, 0)
    return footer, start


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


#: Linux writes at most this many bytes per ``pwrite`` call.
_MAX_WRITE = 0x7FFFF000
#: Syncs a file's data (and its size); macOS has no ``fdatasync``.
sync_data = getattr(os, "fdatasync", os.fsync)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data[:_MAX_WRITE], offset)
        data, offset = data[written:], offset + written


def footer_at(fd: int, offset: int, length: int) -> list[list] | None:
    """The decoded footer that closes the range ``[offset, offset + length)`` of a joined
    file (a part's Parquet file less its leading ``PAR1``); None where there is none."""
    end = offset + length
    try:
        tail = os.pread(fd, 8, end - 8)
        size = struct.unpack("<I", tail[:4])[0] if len(tail) == 8 else 0
        if tail[4:] != MAGIC or not 0 < size <= length - 8:
            return None
        return CompactReader(os.pread(fd, size, end - 8 - size)).struct()
    except (OSError, IndexError, ValueError, struct.error, JoinError):
        return None


class ParquetJoiner:
    """One Parquet file built of parts' bytes: each part's column chunks where they landed,
    and one footer (``close``) listing their row groups in input order. A part is copied in
    whole (``append``: a file's chunks; ``copy``: any byte range, with a footer of its own
    after it), or written in place by its writer into a range it ``reserve``-d (several
    threads at once). ``schema``: the footer fields every part must share (None: the first
    appended file's). ``path`` is cut at ``end`` (None, or a file that does not start with
    ``PAR1``: anew)."""

    def __init__(self, path: Path, schema: list[list] | None = None,
                 end: int | None = None) -> None:
        self.path, self.schema = Path(path), schema
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if end is None or os.pread(self.fd, len(MAGIC), 0) != MAGIC:
                end = len(MAGIC)
                os.pwrite(self.fd, MAGIC, 0)
            os.ftruncate(self.fd, end)
        except OSError:
            self.abort()
            raise
        self.end = end  # where the next part's bytes go
        self.parts: list[tuple[PackedGroups, int]] = []  # ``append``'s: where each begins
        self._lock = threading.Lock()

    def reserve(self, size: int) -> int:
        """Claim ``size`` bytes at the end of the file; returns where."""
        with self._lock:
            base, self.end = self.end, self.end + size
            return base

    def give_back(self, base: int, room: int, used: int) -> None:
        """Return the unused end of a reservation when no later one follows it."""
        with self._lock:
            if self.end == base + room:
                self.end = base + used

    def copy(self, source: Path, offset: int, count: int, tail: bytes = b"") -> int:
        """Append ``count`` bytes at ``offset`` of ``source``, then ``tail``; returns
        where they begin. In the kernel where it can (``copy_file_range``: a reflink where the
        file system shares extents), else by hand."""
        base, done = self.reserve(count + len(tail)), 0
        with open(source, "rb") as handle:
            with contextlib.suppress(OSError, AttributeError):  # by hand, e.g. across devices
                while done < count and (n := os.copy_file_range(
                        handle.fileno(), self.fd, count - done, offset + done, base + done)):
                    done += n
            while done < count:
                block = os.pread(handle.fileno(), min(count - done, 8 << 20), offset + done)
                if not block:
                    raise JoinError("a file ended early")
                pwrite_all(self.fd, memoryview(block), base + done)
                done += len(block)
        pwrite_all(self.fd, memoryview(tail), base + count)
        return base

    def append(self, path: Path) -> None:
        """Copy the row groups of the Parquet file ``path`` (their bytes, as they are)."""
        footer, start = joinable_footer(path)
        if self.schema is None:
            self.schema = schema_part(footer)
        elif schema_part(footer) != self.schema:
            raise JoinError(f"{path} has another schema or metadata than the first file")
        self.parts.append((packed_groups(footer),
                           self.copy(path, len(MAGIC), start - len(MAGIC))))

    def close(self, key_values: dict[bytes, bytes] | None = None,
              parts: list[tuple[PackedGroups, int]] | None = None) -> None:
        """Write one footer, with ``key_values`` added, listing the row groups of ``parts``
        (each part's ``PackedGroups`` and where it begins; default: those appended), in their
        order; then sync and close the file. A group is decoded only to be moved: the parts
        are held as bytes (a decoded footer takes tens of KB, GBs over 10^5 parts)."""
        if self.schema is None:
            raise JoinError("no file to join")
        groups: list[bytes] = []
        rows = 0
        for (packed, part_rows), begins in self.parts if parts is None else parts:
            for data in packed:
                group = CompactReader(data).struct()
                # Its offsets count from its own file's start, where PAR1 preceded its bytes.
                move_group(group, begins - len(MAGIC), len(groups))
                groups.append(encoded(group))
            rows += part_rows
        footer = with_key_values(whole_footer(self.schema, groups, rows), key_values)
        pwrite_all(self.fd, memoryview(footer_bytes(footer)), self.end)
        os.fsync(self.fd)
        self.abort()

    def abort(self) -> None:
        """Close the file as it is."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
