"""A single-file output written once: each part's bytes are appended to one growing file.

A local single-file ``--out`` of one process keeps no part files (they would write every byte
twice). Each writer thread reserves a byte range at the end of ``OUT.partial/_growing.parquet``,
has pyarrow write the part's Parquet file into it but for the leading ``PAR1``, syncs it, then
journals the part: its inputs and its byte range, which ends with the part's own footer. The
run ends with one footer listing every part's row groups in input order, a sync and a rename
(``out`` is never half-written)."""

from __future__ import annotations

import base64
import io
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from ..errors import OutputError, output_os_error
from .parquet_join import (GROUP_NUM_ROWS, MAGIC, JoinError, ParquetJoiner, footer_at,
                           footer_bytes, group_span, joinable_footer, move_group, packed_groups,
                           pwrite_all, read_footer, row_groups, schema_part, sync_data,
                           whole_footer, with_key_values)
from .files import GROWING_NAME, MANIFEST_NAME, temp_path
from .parts import (PartStore, fsync_dir, is_journal_entry,
                     names_part_file, part_intact, drop_cached_pages,
                     error_counts, write_parquet)

log = logging.getLogger("dsv4enc")

#: Positioned writes are POSIX; elsewhere (Windows) a single file is joined from part files.
AVAILABLE = hasattr(os, "pwrite") and hasattr(os, "pread")


def serialize(table: pa.Table, row_group_size: int) -> pa.Buffer:
    """``table`` as a Parquet file in memory, as a part file would hold it: only for the
    schema's probe and a part that outgrew its reservation (a growing buffer costs CPU)."""
    sink = pa.BufferOutputStream()
    write_parquet(table, sink, row_group_size)
    return sink.getvalue()


def _joinable_footer(path: Path) -> list[list] | None:
    """``parquet_join.joinable_footer``'s footer, or None."""
    try:
        return joinable_footer(path)[0]
    except (OSError, JoinError):
        return None


def group_room(table: pa.Table, row_group_size: int) -> int:
    """Bytes to reserve for a part: a little more than its Parquet file (embeddings are stored
    uncompressed, so their Arrow size bounds them; each row group adds a few KB)."""
    groups = -(-max(table.num_rows, 1) // max(row_group_size, 1))
    return int(table.nbytes * 1.01) + (256 << 10) + (32 << 10) * groups


class _NoRoom(Exception):
    """A part's Parquet bytes outgrew its reservation."""


class RangeSink(io.RawIOBase):
    """A write-only file for pyarrow's Parquet writer that puts byte ``i`` it is given at
    ``base + i - 4`` of the growing file (no leading ``PAR1``); past ``room``: ``_NoRoom``."""

    def __init__(self, fd: int, base: int, room: int) -> None:
        self.fd, self.base, self.room = fd, base, room
        self.pos = 0  # bytes given so far (its ``tell``: the offsets its footer holds)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        skip = max(0, len(MAGIC) - self.pos)  # the leading magic, not kept
        if self.pos + size - len(MAGIC) > self.room:
            raise _NoRoom()
        if size > skip:
            pwrite_all(self.fd, view[skip:], self.base + self.pos + skip - len(MAGIC))
        self.pos += size
        return size

    def tell(self) -> int:
        return self.pos

    def writable(self) -> bool:
        return True


class AppendingStore(PartStore):
    """The journaled growing file of a single-file output (the module's doc), joined by a
    ``ParquetJoiner``, and the run's finisher (as ``parts.StreamingAssembler`` of part files)."""

    def __init__(self, folder: Path, settings: dict[str, Any], schema: pa.Schema, out: Path,
                 manifest_name: str = MANIFEST_NAME) -> None:
        super().__init__(folder, settings, manifest_name)
        self.schema, self.out = schema, out
        # What every part's footer holds but its row groups, the same for any table of this
        # schema: in the journal, so that a resume by another pyarrow starts over.
        data = serialize(schema.empty_table(), 1)
        self._shared = schema_part(read_footer(pa.BufferReader(data), data.size)[0])
        packed = footer_bytes(self._shared)[:-8]  # Thrift compact bytes, less length and PAR1
        self.extra = {"footer": base64.b64encode(packed).decode("ascii")}
        self.file: ParquetJoiner | None = None
        #: more key-value metadata for the final footer (its rows' stamps: ``update``)
        self.key_values: dict[bytes, bytes] = {}
        self.dead = False  # a part was dropped: its bytes are in the file, and not output

    @property
    def path(self) -> Path:
        return self.folder / GROWING_NAME

    def create(self) -> None:
        super().create()
        self._cut()

    def _intact_parts(self, data: dict) -> dict[str, dict[str, Any]]:
        """Journal entries whose range is in the file, and joinable part files that a run joining
        part files left (``forget`` copies them in). Changes nothing: the run may yet refuse."""
        same_footer = data.get("footer") == self.extra["footer"]
        if not same_footer and any(is_journal_entry(p) for p in data["parts"].values()):
            log.warning("the finished parts in %s were written with other Parquet metadata "
                        "(another pyarrow?): they are encoded again", self.folder)
        fd, size = None, 0  # its size where it starts with PAR1 (else none of it is recorded)
        try:
            fd = os.open(self.path, os.O_RDONLY)
            size = os.fstat(fd).st_size if os.pread(fd, len(MAGIC), 0) == MAGIC else 0
        except OSError:
            pass
        try:
            return {name: part for name, part in data["parts"].items()
                    if (is_journal_entry(part) and same_footer and size
                        and len(MAGIC) <= part["offset"] <= size - part["length"]
                        and self._part_footer(part, fd) is not None)
                    or (names_part_file(part) and self._joinable(part))}
        finally:
            if fd is not None:
                os.close(fd)

    def _fits(self, footer: list[list] | None) -> bool:
        """A part's footer holds what the output's does but its row groups."""
        return footer is not None and schema_part(footer) == self._shared

    def _joinable(self, part: dict[str, Any]) -> bool:
        """A part file that reads back whole and whose bytes can join this file's."""
        path = self.folder / part["file"]
        return part_intact(path, part.get("rows")) and self._fits(_joinable_footer(path))

    def file_parts(self, path: Path, ignore: bytes) -> list[list]:
        """The parts of a file this store finished (``[row groups, rows]``, in row order)
        whose bytes can join this file's: the same footer but for its rows and its entry
        ``ignore``. A part's row groups lie one after the other, its own footer after them."""
        footer = _joinable_footer(path)
        blank = {ignore: b""}
        if footer is None or (with_key_values(schema_part(footer), blank)
                              != with_key_values(self._shared, blank)):
            return []
        parts, end = [], -1
        for group in row_groups(footer):
            low, high = group_span(group)
            if low != end:
                parts.append([[], 0])
            parts[-1][0].append(group)
            parts[-1][1] += next(f[2] for f in group if f[0] == GROUP_NUM_ROWS)
            end = high
        return parts

    def copy_groups(self, name: str, path: Path, groups: list[list], entry: dict) -> None:
        """Append ``groups`` (a part of ``file_parts`` of ``path``, moved in place) by copying
        their bytes, closed by a footer of their own, and journal them as part ``name``."""
        low, high = group_span(groups[0])[0], group_span(groups[-1])[1]
        for ordinal, group in enumerate(groups):
            move_group(group, len(MAGIC) - low, ordinal)
        try:
            footer = whole_footer(self._shared, groups, entry["rows"])
            self._append_copy(name, path, low, high - low, footer_bytes(footer), entry)
        except JoinError as exc:
            raise OutputError(f"cannot update {self.out}: {path}: {exc}") from None

    def drop(self, names: Sequence[str]) -> None:
        self.dead = self.dead or any(is_journal_entry(self.parts.get(n, {})) for n in names)
        super().drop(names)

    def forget(self, names: Sequence[str]) -> None:
        """Drop the parts this run does not reuse, cut the file, copy in reused part files."""
        super().forget(names)
        self._cut()
        for name, part in list(self.parts.items()):
            if names_part_file(part):
                self._import(name, part)

    def _cut(self) -> None:
        """Open the file cut after the last recorded range (a torn or forgotten part's tail
        goes); one that does not start with ``PAR1`` starts anew."""
        end = max((p["offset"] + p["length"] for p in self.parts.values()
                   if is_journal_entry(p)), default=None)
        self.close()
        try:
            self.file = ParquetJoiner(self.path, self._shared, end)
        except OSError as exc:
            raise output_os_error(self.path, exc) from None

    def _import(self, name: str, part: dict[str, Any]) -> None:
        """Copy a committed part file (a run that joins part files left it: torchrun, Ray,
        a folder-style partial) into the growing file, then delete it."""
        path = self.folder / part["file"]
        entry = {key: part[key] for key in ("start", "end", "digest", "rows", "failed", "transient")
                 if key in part}
        try:
            with open(path, "rb") as source:
                size = os.fstat(source.fileno()).st_size
                read_footer(source, size)  # a damaged file raises JoinError here
            self._append_copy(name, path, len(MAGIC), size - len(MAGIC), b"", entry)
        except JoinError as exc:  # checked by _joinable: only if changed since
            raise OutputError(f"cannot resume: {path}: {exc}; use --overwrite to start "
                              "over") from None
        except OSError as exc:
            raise output_os_error(self.path, exc) from None
        path.unlink(missing_ok=True)

    def commit_written(self, name: str, entry: dict[str, Any]) -> None:
        """A part file another process wrote (``--engine ray``'s actors, where a local run began
        this file): committed as a file, then copied in as a resume copies one (``_import``);
        a kill between leaves it a committed part file, which the next resume copies in."""
        super().commit_written(name, entry)
        self._import(name, self.parts[name])

    def _append_copy(self, name: str, path: Path, offset: int, count: int, tail: bytes,
                     entry: dict[str, Any]) -> None:
        """Append ``count`` bytes at ``offset`` of ``path`` and ``tail``, sync, and journal
        them as part ``name`` (``ParquetJoiner.copy`` reserves its range: writer threads may
        call it at once)."""
        try:
            base = self.file.copy(path, offset, count, tail)
            sync_data(self.file.fd)
        except OSError as exc:
            raise output_os_error(self.path, exc) from None
        self._record(name, {**entry, "offset": base, "length": count + len(tail)})

    def commit(self, name: str, table: pa.Table, row_group_size: int, start: int, end: int,
               digest: str) -> None:
        """Append one part (writer threads commit at once, parts land in any order)."""
        room = group_room(table, row_group_size)
        file = self.file
        base = file.reserve(room)
        try:
            try:
                sink = RangeSink(file.fd, base, room)
                write_parquet(table, pa.PythonFile(sink, mode="w"), row_group_size)
                length = sink.pos - len(MAGIC)  # column chunks, footer, its length, PAR1
            except _NoRoom:  # more than ``group_room`` guessed: it goes through memory instead
                file.give_back(base, room, 0)
                data = serialize(table, row_group_size)
                room = length = data.size - len(MAGIC)
                base = file.reserve(length)
                pwrite_all(file.fd, memoryview(data)[len(MAGIC):], base)
                del data
            footer = footer_at(file.fd, base, length)
            if footer is None:
                raise OutputError(f"cannot write {self.out}: the Parquet writer wrote no footer")
            if not self._fits(footer):
                raise OutputError(f"cannot write {self.out}: a part's Parquet footer differs "
                                  "from the output's")
            file.give_back(base, room, length)
            sync_data(file.fd)  # the bytes are on disk before the journal names them
        except OSError as exc:
            raise output_os_error(self.path, exc) from None
        drop_cached_pages(file.fd, base, length)  # never read back: free the cache now
        self._record(name, {"start": start, "end": end, "digest": digest,
                            "rows": table.num_rows, **error_counts(table),
                            "offset": base, "length": length})

    def notify(self) -> None:
        """Nothing to do: a committed part's bytes are already in the file."""

    def _part_footer(self, part: dict[str, Any], fd: int | None = None) -> list[list] | None:
        """The footer a recorded part's range ends with, if it fits this output's."""
        footer = footer_at(self.file.fd if fd is None else fd, part["offset"], part["length"])
        return footer if self._fits(footer) else None

    def finish(self) -> None:
        """Write one footer for every recorded part's row groups, in input order, after the
        last part, sync, and rename the file to ``out``."""
        ordered = sorted(self.parts.values(), key=lambda p: p["start"])
        for before, after in zip(ordered, ordered[1:]):
            if before["end"] != after["start"]:
                raise OutputError(f"cannot write {self.out}: rows {before['end']} to "
                                  f"{after['start']} were not committed")
        footers = []  # ``PackedGroups``: a decoded footer takes tens of KB, 10^5 parts GBs
        for part in ordered:
            footer = self._part_footer(part)
            if footer is None:
                raise OutputError(f"cannot write {self.out}: the part at byte {part['offset']} "
                                  f"of {self.path} has no footer")
            footers.append((packed_groups(footer), part["offset"]))
        file, path = self.file, self.path
        try:
            if self.dead:  # the ranges of parts a --resume encoded again: not in the output
                file, path = self._compacted(ordered, footers)
            file.close(self.key_values, footers)
            os.replace(path, self.out)
            fsync_dir(self.out.parent)
        except OSError as exc:
            raise output_os_error(self.out, exc) from None
        finally:
            file.abort()
            self.close()
            if path != self.path:
                path.unlink(missing_ok=True)

    def _compacted(self, ordered: list[dict], footers: list) -> tuple[ParquetJoiner, Path]:
        """A new file holding the ranges of the ``ordered`` parts only (``footers``: where
        each begins, moved there); the growing file stays as it is until ``out`` is whole."""
        path = temp_path(self.out, self.folder)
        file = ParquetJoiner(path, self._shared)
        try:
            for k, part in enumerate(ordered):
                footers[k] = (footers[k][0], file.copy(self.path, part["offset"], part["length"]))
        except BaseException:
            file.abort()
            path.unlink(missing_ok=True)
            raise
        return file, path

    def close(self) -> None:
        """Stop without producing ``out``: the file and journal stay for ``--resume``."""
        if self.file is not None:
            self.file.abort()

    abort = close
