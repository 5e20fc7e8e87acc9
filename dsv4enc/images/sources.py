"""Images inside container files (WebDataset tars, Parquet/Arrow tables), and reading an item.

The main process reads only each container's index (a tar's member headers; a table's row-group
sizes and key column); an ``InputItem``'s ``member`` says where an image's bytes lie, and decode
workers read just that (a table cell through a per-process row-group cache). docs/inputs.md
tells the keys and a damaged container's error rows. In a store, each input is read once where
it can be (a shard by one streamed read, an object by its probe, a table's row group by the
probes of its cells), held for the decode (``HeldInputs``)."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tarfile
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import (TYPE_CHECKING, Any, BinaryIO, Iterator, Literal, NamedTuple, Sequence,
                    get_args)

from .. import storage
from ..columns import OUTPUT_METADATA_KEY
from ..errors import UsageError
from .items import (Fetched, InputItem, StoredObject, TableCell, TarMember, Unreadable,
                    is_image_name)

if TYPE_CHECKING:
    import pyarrow as pa

TABLE_EXTENSIONS = (".parquet", ".arrow", ".feather")
TAR_EXTENSIONS = (".tar",)
#: The sidecar members of a WebDataset sample that ``--keep-member`` carries into its rows,
#: by extension: each becomes a string column of that name (a ``.json`` member's raw text).
SidecarMember = Literal["txt", "json", "cls"]
SIDECAR_MEMBERS: tuple[str, ...] = get_args(SidecarMember)
#: The field metadata that marks a kept sidecar member's column (a table may have a column of
#: the same name, which is no table column's value for the rows of a shard, and vice versa).
SIDECAR_FIELD = {b"dsv4enc": b"tar sidecar member"}

#: Bytes of row-group columns a process keeps cached (at least the last one read is kept).
CACHE_BYTES = 256 << 20
#: A Parquet row group holding more than ``CACHE_BYTES`` is read in slices of about this many
#: bytes of rows (a table written as one row group, pyarrow's and pandas' default for up to a
#: million rows, would not fit a decode worker's memory).
SLICE_BYTES = 64 << 20
#: What a header probe of an object in a store reads in its one request: an object (or tar
#: member) no larger is read whole, and its decode reads nothing more.
HEAD_BYTES = 512 << 10
#: Bytes of inputs read ahead that a process holds for their decode (``HeldInputs``): past
#: them, a decode reads its input itself. ``DSV4ENC_HOLD_BYTES`` sets it (0: hold none).
HOLD_BYTES = 256 << 20
_HOLD_ENV = "DSV4ENC_HOLD_BYTES"
#: A tar member no larger is read whole for its decode, in one read (one request in a store);
#: a larger one is read as its decode goes, as a plain file is: a worker never holds it all
#: (a small image followed by gigabytes of padding decodes like the same file on disk).
MEMBER_READ_BYTES = 64 << 20
#: The buffer of a member read as its decode goes (each refill is one read, or one request).
MEMBER_BUFFER_BYTES = 1 << 20


class DamagedContainerError(ValueError):
    """A container's damaged part (its error row says so)."""


class RefusedPathError(ValueError):
    """A table cell's file that dsv4enc does not read (see ``cell_file``)."""


class NoImageColumn(UsageError):
    """A table without the image column asked for, or without any: given by name, a refusal;
    found in a folder (img2dataset's metadata beside its shards), passed over."""


def member_key(container: str, name: str) -> str:
    """The output key of the image ``name`` (a tar sample's key, a member's name, a table
    cell's file name) inside the container keyed ``container``: no other input changes it."""
    return f"{container}/{name}"


def damaged_item(raw: str, offset: int, reason: str, name: str | None = None) -> InputItem:
    """The error row for a container's unreadable part starting at byte ``offset``, keyed
    ``NAME@offset`` (``name``: the container's key, by default ``raw``)."""
    return InputItem(key=f"{name or raw}@{offset}", path=raw,
                     member=Unreadable(f"{raw}: damaged at byte {offset}: {reason}"))


#: What ``HELD`` holds an input's bytes by (``held_key``).
HeldKey = tuple[str, int] | tuple[str, int, int]


class HeldInputs:
    """Inputs' bytes read ahead of their decode, by ``(path, offset)`` (-1: a whole object) or
    a table cell's ``(path, row group, row)``, within ``HOLD_BYTES``: the inputs read first,
    decoded first, keep theirs. Thread-safe."""

    def __init__(self) -> None:
        self._held: dict[HeldKey, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def room(self, size: int) -> bool:
        try:
            budget = int(os.environ.get(_HOLD_ENV) or HOLD_BYTES)
        except ValueError:
            budget = HOLD_BYTES
        return self._bytes + size <= budget

    def hold(self, key: HeldKey, data: bytes) -> None:
        with self._lock:
            if key not in self._held and self.room(len(data)):
                self._held[key] = data
                self._bytes += len(data)

    def peek(self, key: HeldKey | None) -> bytes | None:
        return self._held.get(key)

    def take(self, key: HeldKey | None) -> bytes | None:
        with self._lock:
            data = self._held.pop(key, None)
            self._bytes -= len(data or b"")
            return data

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._bytes = 0


HELD = HeldInputs()


def held_key(item: Any) -> HeldKey | None:
    """What ``HELD`` holds an item's bytes by: an object in a store, a tar member or a table
    cell in one (a decode worker would read the cell's whole row group again)."""
    member = getattr(item, "member", None)
    if isinstance(member, StoredObject):
        return item.path, -1
    if isinstance(member, TarMember) and storage.reads_are_requests(item.path):
        return item.path, member.offset
    if isinstance(member, TableCell) and storage.reads_are_requests(item.path):
        return item.path, member.group, member.row
    return None


def attach_held(source: Any) -> Any:
    """``source`` as a decode task sends it: an item whose bytes are held carries them
    (``Fetched``; no longer held here), anything else is left as it is."""
    data = HELD.take(held_key(source))
    if data is None:
        return source
    member = source.member
    cell = member if isinstance(member, TableCell) else None
    return replace(source, member=Fetched(getattr(member, "name", None), data, cell))


def _read_ahead(item: InputItem) -> BinaryIO:
    """A file over an object's (or a tar member's) bytes in a store for a header probe: its
    first ``HEAD_BYTES`` in one request, held for the decode when that is all of it; a table
    cell's bytes, from its row group read for the probes, held while ``HELD`` has room."""
    key = held_key(item)
    if (held := HELD.peek(key)) is not None:
        return io.BytesIO(held)
    member = item.member
    if isinstance(member, TableCell):
        handle = read_table_cell(item.path, member, stream=True)
        if isinstance(handle, str) or not HELD.room(handle.size()):
            return handle
        HELD.hold(key, data := handle.read())
        return io.BytesIO(data)
    if isinstance(member, TarMember):
        start, size = member.offset, member.size
        head = storage.read_range(item.path, start, min(size, HEAD_BYTES))
    else:
        start = 0
        head, size = storage.read_head(item.path, HEAD_BYTES)
    if len(head) >= size:
        HELD.hold(key, head)
        return io.BytesIO(head)
    return storage.open_range(item.path, start, size, head, buffer_size=256 << 10)


#: Compressors a tar shard may be packed with (it then cannot be read member by member): its
#: name's endings, its leading bytes, and the command that undoes it.
_COMPRESSORS = {
    "gzip": ((".tar.gz", ".tgz"), b"\x1f\x8b", "gunzip -k"),
    "bzip2": ((".tar.bz2", ".tbz2", ".tbz"), b"BZh", "bunzip2 -k"),
    "xz": ((".tar.xz", ".txz"), b"\xfd7zXZ\x00", "unxz -k"),
    "zstd": ((".tar.zst", ".tar.zstd", ".tzst"), b"\x28\xb5\x2f\xfd", "unzstd"),
    "lz4": ((".tar.lz4",), b"\x04\x22\x4d\x18", "unlz4"),
}


def refuse_compressed_tar(raw: str) -> None:
    """A UsageError for a compressed tar shard given by name (``x.tar.gz``, ``x.tgz``, ...)."""
    for kind, (suffixes, _, command) in _COMPRESSORS.items():
        if raw.lower().endswith(suffixes):
            raise UsageError(f"{raw}: a {kind}-compressed tar shard; only uncompressed .tar "
                             f"shards are read (member by member), so decompress it first "
                             f"({command} {raw}) and give the .tar")


def container_kind(path: str) -> str | None:
    """``"table"``, ``"tar"`` or None, from the file name's extension."""
    lower = path.lower()
    return ("table" if lower.endswith(TABLE_EXTENSIONS) else
            "tar" if lower.endswith(TAR_EXTENSIONS) else None)


# ----------------------------------------------------------------------------- tar shards

class MemberName(NamedTuple):
    """A tar member's name split once, for every use the index makes of it (a shard of
    millions of members splits each name once, not once per use)."""

    path: str  #: ``PurePosixPath(name).as_posix()``: what a hard link names its target by
    base: str  #: the file name (the last part; "" for a name without one)
    key: str  #: WebDataset's ``__key__``: the folder and the file name up to its first dot
    ext: str  #: the extension, after that first dot ("" for a file name without a dot)


def split_member(name: str) -> MemberName:
    """``name`` split as ``PurePosixPath(name)`` splits it, and WebDataset's key and extension
    read from that split (``a/b.seg.png`` -> key ``a/b``, extension ``seg.png``)."""
    root, parts = posix_parts(name)
    base = parts[-1] if parts else ""
    parent = root + "/".join(parts[:-1]) or "."
    stem, dot, ext = base.partition(".")
    return MemberName(root + "/".join(parts) or ".", base,
                      stem if parent == "." else f"{parent}/{stem}", ext if dot else "")


def posix_parts(name: str) -> tuple[str, list[str]]:
    """``name`` split as ``PurePosixPath(name)`` splits it: its root (``""``, ``"/"``, or
    ``"//"`` for exactly two leading slashes) and its parts, without empty or ``.`` ones. Plain
    strings: a shard of millions of members makes no path object, nor interned part, for each."""
    stripped = name.lstrip("/")
    leading = len(name) - len(stripped)
    root = "//" if leading == 2 else "/" if leading else ""
    return root, [part for part in stripped.split("/") if part and part != "."]


def posix_path(name: str) -> str:
    """``PurePosixPath(name).as_posix()``, from ``split_member``."""
    return split_member(name).path


_BLOCK = tarfile.BLOCKSIZE
#: The most bytes an extended header of a tar (a GNU long name or link, a pax header) may hold:
#: tarfile reads one whole, at once, so a damaged size field (up to 2**88) would ask for that
#: many. A larger one is a damaged header. Go's archive/tar draws the same line.
EXTENDED_HEADER_BYTES = 1 << 20


class _HeaderReads:
    """The shard as tarfile reads it (headers, and extended headers' data): a read of more
    than ``EXTENDED_HEADER_BYTES`` is an invalid header, which tarfile skips a block at a time
    as it does any (``expand_tar`` reports the gap), never a read of that size. The index's own
    reads of members' data go to ``handle``."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.seek, self.tell = handle.seek, handle.tell

    def read(self, size: int = -1) -> bytes:
        if size > EXTENDED_HEADER_BYTES:
            raise tarfile.InvalidHeaderError(f"an extended header of {size} bytes")
        return self.handle.read(size)


def _open_tar(raw: str) -> tuple[tarfile.TarFile | None, int, str | None]:
    """``(archive, file size, None)``, or ``(None, size, why)`` when not even the first header
    reads, or the file is compressed (one shard among many: its error row says to decompress
    it, and the other shards are read)."""
    try:
        # In a store, the shard is read once, in order: headers and members' data alike.
        handle, size = storage.open_whole(raw)
    except OSError as exc:
        return None, 0, f"cannot read it: {exc.strerror or exc}"
    try:
        head = handle.peek(8)[:8]
        for kind, (_, magic, _) in _COMPRESSORS.items():
            if head.startswith(magic):
                handle.close()
                return None, size, (f"a {kind}-compressed tar; only uncompressed shards can be "
                                    "read member by member, so decompress it first")
        archive = tarfile.open(fileobj=_HeaderReads(handle), mode="r:")
    except (tarfile.TarError, OSError) as exc:
        handle.close()
        return None, size, f"not a tar file, or its first header is damaged ({exc})"
    # A damaged header is skipped block by block up to the next valid one (as GNU tar does);
    # ``expand_tar`` reports the gaps instead of ending the index silently.
    archive.ignore_zeros = True
    if archive.firstmember is None:  # a zero block first: an empty archive joined in front
        archive.offset = _BLOCK  # read on after it, as after any end marker (else: no member)
    return archive, size, None


def _first_nonzero(handle: BinaryIO, start: int, stop: int) -> int | None:
    """The offset of the first non-zero byte in ``[start, stop)`` of the open file, if any."""
    handle.seek(start)
    at = start
    while at < stop and (chunk := handle.read(min(1 << 20, stop - at))):
        stripped = chunk.lstrip(b"\0")
        if stripped:
            return at + len(chunk) - len(stripped)
        at += len(chunk)
    return None


def _gap_damage(handle: BinaryIO, start: int, stop: int) -> int | None:
    """Where the bytes between two members (``[start, stop)``) of the open archive hold
    something other than zero blocks and pax global headers (which tarfile reads without
    yielding a member); the file is left where it was."""
    at = handle.tell()
    try:
        while start < stop:
            handle.seek(start)
            try:
                info = tarfile.TarInfo.frombuf(handle.read(_BLOCK), "utf-8", "surrogateescape")
            except tarfile.HeaderError:
                break
            if info.type != tarfile.XGLTYPE:
                break
            start += _BLOCK + -(-info.size // _BLOCK) * _BLOCK
        return _first_nonzero(handle, start, stop) if start < stop else None
    finally:
        handle.seek(at)


def _tar_end_damage(handle: BinaryIO, end: int, size: int,
                    last: str | None) -> tuple[int, str] | None:
    """``(offset, reason)`` unless the archive (``handle``), whose last member's data ends at
    ``end``, ends as a tar should: with its end-of-archive marker (zero blocks)."""
    if end > size:
        return size, f"the file ends inside the data of member {last!r} (cut short?)"
    if end == size:
        return size, "the file ends without the tar end-of-archive marker (cut short?)"
    if _first_nonzero(handle, end, min(size, end + _BLOCK)) is not None:
        return end, ("no valid tar header here and up to the end of the file (a damaged or "
                     "cut header); members there are lost")
    return None


def _backward_step(info: tarfile.TarInfo, next_header: int, end: int) -> str | None:
    """Why the member ``info`` (whose next header tarfile reads at ``next_header``; the member
    before it ended at ``end``) sends the index back, or None: a negative size field (base-256,
    or a pax ``size`` record) makes tarfile read the same header again, endlessly."""
    if info.size < 0:
        return (f"tar member {info.name!r} has a negative size ({info.size}), a damaged "
                "header; the rest is not read")
    if info.offset < end or next_header <= info.offset:
        return (f"tar member {info.name!r} points back into the archive (a damaged header); "
                "the rest is not read")
    return None


def _tar_locator(info: tarfile.TarInfo, raw: str,
                 files: dict[str, TarMember]) -> TarMember | Unreadable:
    """Where a member's bytes are (its own data, a hard link target's), or why not."""
    if info.isreg() and not info.issparse():
        return TarMember(info.name, info.offset_data, info.size)
    if info.islnk():
        target = files.get(posix_path(info.linkname))
        if target is not None:
            return TarMember(info.name, target.offset, target.size)
        return Unreadable(f"{raw}: tar member {info.name!r} is a hard link to "
                          f"{info.linkname!r}, which is not a file before it in the archive")
    if info.issym():
        return Unreadable(f"{raw}: tar member {info.name!r} is a symbolic link to "
                          f"{info.linkname!r}; links are not followed inside tar shards")
    kind = "a sparse file" if info.issparse() else "not a regular file"
    return Unreadable(f"{raw}: tar member {info.name!r} is {kind}")


def _keep_member(handle: BinaryIO, raw: str, found: TarMember | Unreadable) -> None:
    """Hold an image member's bytes in a store's shard for its probe and decode (``HELD``) as
    the index passes them, while the budget lasts (else they are read by range)."""
    if (not isinstance(found, TarMember) or not storage.reads_are_requests(raw)
            or found.offset != handle.tell() or not HELD.room(found.size)):
        return
    with contextlib.suppress(OSError):  # the index reads on and reports the damage
        data = handle.read(found.size)
        if len(data) == found.size:
            HELD.hold((raw, found.offset), data)


def _sidecar_text(handle: BinaryIO, member: TarMember, size: int) -> str | None:
    """A sidecar member's text (other bytes than UTF-8 as backslash escapes) from where its
    data lies (``_tar_locator``: its own, or a hard link target's), read as the index passes it
    (in a store, from the shard's one stream); None when it cannot be read, or when its data
    would pass the end of the shard (``size`` bytes): a damaged size field may claim 2**62
    bytes, which one read would ask for at once."""
    if member.offset + member.size > size:
        return None  # the index reports the shard cut inside this member
    try:
        handle.seek(member.offset)
        data = handle.read(member.size)
    except OSError:
        return None  # the index reads on and reports the damage
    return data.decode("utf-8", "backslashreplace") if len(data) == member.size else None


def expand_tar(raw: str, name: str | None = None,
               keep_members: Sequence[str] = ()) -> tuple[list[InputItem], int]:
    """Index an uncompressed tar shard: its image members (by extension) in file order, keyed
    by sample under ``name`` (by default ``raw``), and an error row where it is damaged.
    ``keep_members``: the extensions of the sidecar members whose text each image of the
    sample carries (``InputItem.sidecars``; the last of a repeated name counts)."""
    name = name or raw
    archive, size, why = _open_tar(raw)
    if archive is None:
        return [damaged_item(raw, 0, why, name)], 0
    handle = archive.fileobj.handle  # the shard's file: tarfile reads through ``_HeaderReads``
    items: list[InputItem] = []
    samples: dict[str, list[tuple[int, str]]] = {}  # sample key -> (index, name) of its images
    files: dict[str, TarMember] = {}  # every regular member: targets of hard links
    other_keys: set[str] = set()
    sidecars: dict[str, dict[str, str]] = {}  # sample key -> kept extension -> text
    end, last = 0, None  # where the previous member's data ends: the next header starts there
    damage: tuple[int, str] | None = None
    with archive:
        # A member whose data passes the file's end (a size field may claim up to 2**88 bytes)
        # ends the index: tarfile would seek its next header there, and past 2**63 it raises.
        while end <= size:
            try:
                info = archive.next()
            except tarfile.ReadError:
                if archive.offset >= size:  # "unexpected end of data": cut inside a member
                    break
                # A damaged header after a long-name or pax header: skip it like any other.
                archive.offset += _BLOCK
                continue
            except OSError as exc:  # a read error: no way on
                damage = archive.offset, f"unreadable here ({exc}); the rest is not read"
                break
            if info is None:
                break
            archive.members.clear()  # tarfile keeps each header it read: ~1 KB per member
            if (why := _backward_step(info, archive.offset, end)) is not None:
                damage = info.offset, why
                break
            bad = _gap_damage(handle, end, info.offset) if info.offset > end else None
            if bad is not None:  # zeros are fine: an end marker between joined archives
                items.append(damaged_item(raw, bad, (
                    f"no valid tar header up to byte {info.offset} (a damaged header, or a "
                    "wrong size field before it); members there are lost"), name))
            end, last = archive.offset, info.name
            path, base, key, ext = split_member(info.name)  # one split for each use below
            if info.isreg() and not info.issparse():
                files[path] = TarMember(info.name, info.offset_data, info.size)
            if info.isdir() or base.startswith(".") or not key:
                continue
            if is_image_name(base):
                found = _tar_locator(info, raw, files)
                _keep_member(handle, raw, found)
                samples.setdefault(key, []).append((len(items), info.name))
                items.append(InputItem(key=member_key(name, key), path=raw, member=found))
            else:
                other_keys.add(key)
                if ext in keep_members:  # its own data, or a hard link target's
                    kept = _tar_locator(info, raw, files)
                    if isinstance(kept, TarMember) and (
                            text := _sidecar_text(handle, kept, size)) is not None:
                        sidecars.setdefault(key, {})[ext] = text
    if damage is None:  # in a store, the end is still in the stream's buffer, as a rule
        damage = _tar_end_damage(handle, end, size, last)
    handle.close()  # a file object given to tarfile is the caller's to close
    if damage is not None:
        items.append(damaged_item(raw, *damage, name))
    for key, images in samples.items():
        kept = tuple(sidecars.get(key, {}).items())
        for index, member in images:
            if len(images) > 1:  # several images in one sample: each keyed by its member name
                items[index] = replace(items[index], key=member_key(name, member))
            if kept:
                items[index] = replace(items[index], sidecars=kept)
    return items, len(other_keys - samples.keys())


def read_tar_member(path: str, member: TarMember) -> bytes:
    """The member's bytes, read by offset and size (no tar parsing): one read, one request,
    into the bytes returned (no copy on the way)."""
    data = storage.read_range(path, member.offset, member.size)
    if len(data) != member.size:
        raise EOFError(f"tar member {member.name} is truncated ({len(data)} of "
                       f"{member.size} bytes)")
    return data


# ----------------------------------------------------------------------------- tables

def image_column_kind(dtype: "pa.DataType") -> str | None:
    """``"bytes"`` for a binary column (dictionary-encoded or not), ``"struct"`` for a
    ``{bytes, path}`` struct."""
    import pyarrow as pa

    def is_binary(t) -> bool:
        return (pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(t)))

    if is_binary(dtype) or (pa.types.is_dictionary(dtype) and is_binary(dtype.value_type)):
        return "bytes"
    if pa.types.is_struct(dtype):
        index = dtype.get_field_index("bytes")
        if index >= 0 and is_binary(dtype.field(index).type):
            return "struct"
    return None


def choose_image_column(schema: "pa.Schema", wanted: str | None, source: str) -> str:
    """The image column: ``wanted`` (checked), else the only bytes-like one, else ``image``."""
    names = schema.names
    if wanted is not None:
        if wanted not in names:
            raise NoImageColumn(f"{source}: no column {wanted!r} (columns: {', '.join(names)})")
        if image_column_kind(schema.field(wanted).type) is None:
            raise NoImageColumn(f"{source}: column {wanted!r} is {schema.field(wanted).type}, "
                                "not image bytes or a {bytes, path} struct")
        return wanted
    # by field, not by name: a name two columns share finds neither (``repeated_column``)
    candidates = [f.name for f in schema if image_column_kind(f.type) is not None]
    if len(candidates) == 1:
        return candidates[0]
    if "image" in candidates:
        return "image"
    if not candidates:
        # --image-column could name no other: a column it names must hold bytes too
        raise NoImageColumn(f"{source}: no column holds image bytes or {{bytes, path}} structs "
                            f"(columns: {', '.join(names)}); give a table with such a column")
    raise UsageError(f"{source}: several columns hold bytes ({', '.join(candidates)}); "
                     "choose one with --image-column")


def written_by_dsv4enc(path: str) -> bool:
    """Whether the Parquet file ``path`` is an output of dsv4enc (its footer's schema metadata
    holds the entry ``output/parts.output_schema`` writes), which may lie beside the shards."""
    import pyarrow as pa

    if not path.lower().endswith(".parquet"):
        return False
    try:
        return is_output_schema(GROUP_CACHE.table(path).schema)
    except (OSError, pa.ArrowException, UnicodeDecodeError):
        return False  # not readable: its error row says why


def is_output_schema(schema: "pa.Schema") -> bool:
    """Whether a table of ``schema`` is an output of dsv4enc (its metadata's entry)."""
    return OUTPUT_METADATA_KEY in (schema.metadata or {})


class TableReader:
    """Read access to a Parquet file or an Arrow IPC file/stream, group by group; opening
    raises when nothing can be read. ``damage``: ``(byte offset, reason)`` when an Arrow stream
    (or a file without its footer) breaks off before its end-of-stream marker."""

    def __init__(self, path: str, count_by: str | None = None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        self.parquet = path.lower().endswith(".parquet")
        self.damage: tuple[int, str] | None = None
        self._slices: dict[int, int | None] = {}  # ``slice_rows`` by group
        if self.parquet:
            # In a store, each row group's column chunk is one ranged read; a file is mapped.
            self._file = pq.ParquetFile(storage.open_input(path))
            self.schema = self._file.schema_arrow
            meta = self._file.metadata
            self.group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            return
        source = storage.open_input(path)
        try:
            reader = pa.ipc.open_file(source)
            self.schema = reader.schema
            self._source, self._readers = source, {(): reader}
            self._counted: list["pa.RecordBatch | None"] = []
            # Each batch is read when ``read`` asks for it, only the columns asked for: a
            # compressed file's (Feather's default) are decompressed one at a time, never all
            # held at once, and a batch's images are fetched once, by the probe that reads them
            # (rows are counted by reading ``count_by``, the listing's key column, else the
            # narrowest column, ``count_column``).
            self._counted_by = count_by
            if count_by is not None and self.schema.get_field_index(count_by) >= 0:
                # The listing's keys, which it reads next
                self._counted = [self._batch(i, [count_by])
                                 for i in range(reader.num_record_batches)]
                self.group_rows = [batch.num_rows for batch in self._counted]
            else:
                self.group_rows = [self._batch(i, self.count_column()).num_rows
                                   for i in range(reader.num_record_batches)]
        except pa.ArrowInvalid:
            # Hugging Face `datasets` caches are IPC streams; read zero-copy from the map. An
            # IPC file without its footer (cut short) is its magic and then a stream.
            source.seek(0)
            cut_file = source.read(6) == b"ARROW1"
            source.seek(8 if cut_file else 0)
            self._read_stream(source)
            if cut_file and self.damage is None:
                self.damage = source.size(), "the Arrow file has no footer (cut short?)"
            self.group_rows = [b.num_rows for b in self._batches]

    def count_column(self) -> list[str]:
        """The column an Arrow file's rows are counted by, without reading its images: the
        narrowest type's (a fixed width before a variable one, a string before a struct of
        images); none (the whole batch) when no column's name is its own."""
        import pyarrow as pa

        def width(field: "pa.Field") -> tuple[int, int]:
            if pa.types.is_null(field.type):  # no buffers at all
                return 0, 0
            if pa.types.is_dictionary(field.type):  # its dictionary may hold the images
                return 2, 0
            try:
                return 0, field.type.bit_width
            except ValueError:  # variable width: binary and strings before nested types
                return 1 if pa.types.is_nested(field.type) else 0, 1 << 30
        named = [f for f in self.schema if self.schema.get_field_index(f.name) >= 0]
        return [min(named, key=width).name] if named else []

    def _batch(self, group: int, columns: list[str]) -> "pa.RecordBatch":
        """Batch ``group`` of ``columns`` alone: an Arrow file's read by a reader of theirs
        (each column's buffers one read; its footer read once per set of columns asked)."""
        import pyarrow as pa

        if not hasattr(self, "_readers"):  # a stream's, all read
            return self._batches[group].select(columns)
        if self._counted and columns == [self._counted_by]:
            counted, self._counted[group] = self._counted[group], None
            if counted is not None:  # read to count the rows: handed on once, not held
                return counted
        fields = tuple(sorted(self.schema.get_field_index(c) for c in columns))
        if fields not in self._readers:
            self._readers[fields] = pa.ipc.open_file(
                self._source, options=pa.ipc.IpcReadOptions(included_fields=list(fields)))
        return self._readers[fields].get_batch(group).select(columns)

    def _read_stream(self, source) -> None:
        """An IPC stream's batches, up to its end marker or to where it breaks off (``damage``)."""
        import pyarrow as pa

        reader = pa.ipc.open_stream(source)
        self.schema = reader.schema
        self._batches = []
        while True:
            at = source.tell()
            try:
                self._batches.append(reader.read_next_batch())
            except StopIteration:
                if source.tell() == at:  # the end of the file, not the end-of-stream marker
                    self.damage = at, ("the Arrow stream ends without its end-of-stream "
                                       "marker (cut short?); rows after it are lost")
                return
            except (OSError, pa.ArrowException) as exc:
                self.damage = at, f"an unreadable record batch ({exc}); the rest is not read"
                return

    def slice_rows(self, group: int) -> int | None:
        """The rows of a slice of a Parquet row group over ``CACHE_BYTES``; None: read it whole."""
        if not self.parquet:
            return None  # an Arrow batch is used where it lies in the file, not read
        if group not in self._slices:  # asked once per cell: the footer is walked once a group
            meta = self._file.metadata.row_group(group)
            # The group's own total of its columns' uncompressed sizes: pyarrow aborts the
            # process (an uncaught C++ exception) building a damaged column chunk's metadata.
            size = meta.total_byte_size
            self._slices[group] = (None if size <= CACHE_BYTES
                                   else max(1, meta.num_rows * SLICE_BYTES // size))
        return self._slices[group]

    def read_slices(self, group: int, column: str, rows: int) -> Iterator["pa.Array"]:
        """``column`` of row group ``group``, ``rows`` rows at a time, in order."""
        for batch in self._file.iter_batches(rows, row_groups=[group], columns=[column]):
            yield batch.column(0)

    def read(self, group: int, columns: list[str]) -> "pa.Table":
        import pyarrow as pa

        if self.parquet:
            return self._file.read_row_group(group, columns=columns)
        table = pa.Table.from_batches([self._batch(group, columns)])
        # IPC data is used as it lies in the file: offsets pointing outside their buffers
        # would be read blindly (a crash, not an error row). Check the columns read, a string
        # one as bytes: a cell not UTF-8 is read as its bytes (``unchecked_values``), as Parquet's.
        for chunk in (chunk for column in table.columns for chunk in column.chunks):
            chunk.view(_strings_as_bytes(chunk.type)).validate(full=True)
        return table


def _strings_as_bytes(dtype: "pa.DataType") -> "pa.DataType":
    """``dtype`` with its strings (a struct's fields too: a {bytes, path} cell's path) as the
    binary type of their layout, which a full check does not test for UTF-8."""
    import pyarrow as pa

    if pa.types.is_struct(dtype):
        return pa.struct([field.with_type(_strings_as_bytes(field.type)) for field in dtype])
    return {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}.get(dtype, dtype)


def expand_table(raw: str, image_column: str | None = None, key_column: str | None = None,
                 path_roots: tuple[str, ...] = (), name: str | None = None) -> list[InputItem]:
    """One item per row of a Parquet/Arrow file (only the key column is read), keyed under
    ``name`` (the table's key, by default ``raw``), and an error row where it is damaged. Its
    reader (its footer read) is this listing's own, then left in ``GROUP_CACHE`` for the
    probes and the kept columns."""
    import pyarrow as pa

    name = name or raw
    try:
        table = GROUP_CACHE.take(raw) or TableReader(raw, count_by=key_column)
        table.schema.names  # an Arrow schema's names are decoded when first asked for
    except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:  # a name not UTF-8
        return [damaged_item(raw, 0, f"cannot read it as a table: {misnamed_table(raw) or exc}",
                             name)]
    # an output's ``embedding`` is bytes too
    if image_column is None and table.parquet and is_output_schema(table.schema):
        raise NoImageColumn(f"{raw}: an output of dsv4enc (embeddings, not images); give the "
                            "images it was encoded from")
    column = choose_image_column(table.schema, image_column, raw)
    if key_column is not None and key_column not in table.schema.names:
        raise UsageError(f"{raw}: no key column {key_column!r} "
                         f"(columns: {', '.join(table.schema.names)})")
    if (repeated := repeated_column(table.schema, [column, key_column])) is not None:
        return [damaged_item(raw, 0, repeated, name)]
    struct = image_column_kind(table.schema.field(column).type) == "struct"
    has_path = struct and table.schema.field(column).type.get_field_index("path") >= 0
    items: list[InputItem] = []  # one per row: its number is len(items)
    for group, n_rows in enumerate(table.group_rows):
        keys: list[Any] = [None] * n_rows
        unreadable = None
        try:
            if key_column is not None:
                keys = unchecked_values(table.read(group, [key_column]).column(0))
            elif has_path:  # Parquet reads just the struct's path field
                wanted = f"{column}.path" if table.parquet else column
                paths = table.read(group, [wanted]).column(0).combine_chunks()
                keys = unchecked_values(paths.field("path"))
        except (OSError, pa.ArrowException) as exc:  # each row of the group is an error row
            unreadable = Unreadable(f"{raw}: row group {group} cannot be read ({exc})")
        for row, key in enumerate(keys):
            if isinstance(key, bytes):  # bytes that are not UTF-8 as ``\xNN``, as a file name's
                key = key.decode("utf-8", "backslashreplace")
            if key is None or key == "":
                key = f"{name}#{len(items)}"
            else:
                key = str(key) if key_column is not None else member_key(name, str(key))
            items.append(InputItem(key=key, path=raw, member=unreadable or TableCell(
                column, group, row, path_roots)))
    if table.damage is not None:
        items.append(damaged_item(raw, *table.damage, name))
    GROUP_CACHE.adopt(raw, table)
    return items


def misnamed_table(raw: str) -> str | None:
    """What a table that does not open holds when its first bytes say so (a Parquet file named
    ``.arrow``, an Arrow file or stream named ``.parquet``, Feather v1): said in its error
    row, where the reader's words ('Expected to read 827474256 metadata bytes') name no cause."""
    try:
        head = storage.read_range(raw, 0, 8)
    except OSError:
        return None
    parquet = raw.lower().endswith(".parquet")
    if not parquet and head.startswith(b"PAR1"):
        return "it holds Parquet data, not Arrow IPC: name it .parquet"
    if parquet and head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):
        return "it holds Arrow IPC data, not Parquet: name it .arrow"
    if head.startswith(b"FEA1"):
        return "it is a Feather v1 file, which is not read: write it as Feather v2 (Arrow IPC)"
    return None


def repeated_column(schema: "pa.Schema", names: Sequence[str | None]) -> str | None:
    """Why the table cannot be read when one of ``names`` is the name of several columns
    (Parquet and Arrow allow it; columns are read by name, and neither would be found)."""
    for name in names:
        if name is not None and (count := schema.names.count(name)) > 1:
            return f"{count} columns named {name!r}: dsv4enc reads columns by name"
    return None


def table_fields(paths: Sequence[str], names: Sequence[str]) -> list["pa.Field"]:
    """The fields of the columns ``names`` over the tables ``paths`` (each table's schema is
    read once, by the reader its listing left in ``GROUP_CACHE``): every table must have each
    column, in one type, that Parquet holds (an Arrow file's union or run-end-encoded one has
    no Parquet type: it would fail at the first part written). A UsageError otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields: dict[str, "pa.Field"] = {}
    for path in paths:
        schema = GROUP_CACHE.table(path).schema
        for name in names:
            if name not in schema.names:
                raise UsageError(f"{path}: no column {name!r} to keep "
                                 f"(columns: {', '.join(schema.names)})")
            if (repeated := repeated_column(schema, [name])) is not None:
                raise UsageError(f"{path}: {repeated}; it cannot be kept")
            field = schema.field(name)
            first = fields.setdefault(name, field)
            if first.type != field.type:
                raise UsageError(f"column {name!r} is {first.type} in one table and "
                                 f"{field.type} in {path}: the tables of one run must agree")
    for name, field in fields.items():
        try:  # a value as ``kept_values`` builds it, written as a part writes it
            pq.write_table(pa.table({name: pa.array([None], field.type)}), pa.BufferOutputStream())
        except pa.ArrowException:
            raise UsageError(f"column {name!r} is {field.type}, which a Parquet output cannot "
                             "hold; it cannot be kept") from None
    return [fields[name].with_nullable(True) for name in names if name in fields]


def sidecar_fields(keep_members: Sequence[str]) -> list["pa.Field"]:
    """The string columns of the kept sidecar members ``keep_members``, in order."""
    import pyarrow as pa

    return [pa.field(ext, pa.string(), metadata=SIDECAR_FIELD)
            for ext in dict.fromkeys(keep_members)]


def kept_values(items: Sequence[InputItem], fields: Sequence["pa.Field"]) -> dict[str, "pa.Array"]:
    """The columns ``fields`` for ``items``, in order: a tar sample's kept sidecar text
    (``InputItem.sidecars``), a table row's own cell (through ``GROUP_CACHE``; an item whose
    image was ``Fetched`` too), else null (a cell of a page that cannot be read too: its image,
    read apart, may be fine)."""
    import pyarrow as pa

    def value(item: InputItem, field: "pa.Field") -> Any:
        if field.metadata == SIDECAR_FIELD:
            return dict(item.sidecars).get(field.name)
        cell = item.member.cell if isinstance(item.member, Fetched) else item.member
        if isinstance(cell, TableCell):
            try:
                got = unchecked_values(GROUP_CACHE.value(item.path, cell.group, cell.row,
                                                         field.name))
            except (OSError, pa.ArrowException, DamagedContainerError):  # a damaged page
                return None
            if isinstance(got, bytes) and field.type in (pa.string(), pa.large_string()):
                return got.decode("utf-8", "backslashreplace")  # a cell that is not UTF-8
            return got
        return None

    return {field.name: pa.array([value(item, field) for item in items], type=field.type)
            for field in fields}


#: Tables whose readers (their footers, read once) a process keeps open (``GroupCache``).
OPEN_TABLES = 16


class GroupCache:
    """Recently read row-group columns of this process (a large Parquet group's in slices,
    ``TableReader.slice_rows``), least recently used dropped first, and the readers of the
    last ``OPEN_TABLES`` tables it read (in a store, a footer read is a request)."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tables: dict[str, TableReader] = {}
        # (path, group, column, first row) -> the column's values from that row on
        self._columns: OrderedDict[tuple[str, int, str, int], Any] = OrderedDict()
        # (path, group, column) -> the next slice's first row, and the reader that gives it
        self._readers: dict[tuple[str, int, str], tuple[int, Iterator[Any] | None]] = {}
        self._bytes = 0

    def table(self, path: str) -> TableReader:
        """This process's reader of ``path``: the one kept, else a new one, kept."""
        with self._lock:
            return self._table(path)

    def _table(self, path: str) -> TableReader:
        table = self._tables.get(path)
        if table is None:
            table = TableReader(path)
            self._adopt(path, table)
        return table

    def take(self, path: str) -> TableReader | None:
        """The reader kept for ``path``, no longer kept: one caller reads with it alone (a
        listing, whose reads take no lock) and gives it back (``adopt``)."""
        with self._lock:
            return self._tables.pop(path, None)

    def adopt(self, path: str, table: TableReader) -> None:
        """Keep ``table`` as the reader of ``path`` (in place of one kept: the newest is kept)."""
        with self._lock:
            self._adopt(path, table)

    def _adopt(self, path: str, table: TableReader) -> None:
        self._tables.pop(path, None)
        if len(self._tables) >= OPEN_TABLES:
            self._tables.pop(next(iter(self._tables)))
        self._tables[path] = table

    def value(self, path: str, group: int, row: int, column: str):
        """The ``pyarrow`` scalar at ``row`` of ``column`` in row group ``group`` of ``path``."""
        with self._lock:
            table = self._table(path)
            rows = table.slice_rows(group)
            start = 0 if rows is None else row - row % rows
            key = (path, group, column, start)
            if key not in self._columns and rows is None:
                chunks = table.read(group, [column]).column(0)
                # One chunk (the usual case) is used as it is: combining copies it, and a row
                # group of large images is hundreds of megabytes.
                self._keep(key, chunks.chunk(0) if chunks.num_chunks == 1
                           else chunks.combine_chunks())
            elif key not in self._columns:
                self._read_slices(table, key, rows)
            values = self._columns.get(key, ())
            if row - start >= len(values):  # a page the reader skipped (of an unknown type)
                raise DamagedContainerError(f"{path}: column {column!r} of row group {group} "
                                            f"holds fewer values than its rows (damaged)")
            self._columns.move_to_end(key)
            return values[row - start]

    def _read_slices(self, table: TableReader, key: tuple[str, int, str, int], rows: int) -> None:
        """Read on to the slice ``key``, keeping each slice read; from the group's start when
        the reader is past it (rows are asked for in their batches' order, mostly forward)."""
        path, group, column, start = key
        at, reader = self._readers.get(key[:3], (0, None))
        if reader is None or at > start:
            at, reader = 0, table.read_slices(group, column, rows)
        while at <= start and (values := next(reader, None)) is not None:  # None: a page skipped
            self._keep((path, group, column, at), values)
            at += rows
        self._readers[key[:3]] = at, reader

    def _keep(self, key: tuple[str, int, str, int], array: Any) -> None:
        self._columns[key] = array
        self._bytes += array.nbytes
        while self._bytes > self.max_bytes and len(self._columns) > 1:
            _, dropped = self._columns.popitem(last=False)
            self._bytes -= dropped.nbytes

    def release(self) -> None:
        """Drop the columns read, but the furthest of each table's column, and keep the
        readers: the next window's probes, or the writer's next part, go on where the last
        stopped (rows are read in order), in the row group they share as a rule (parts cut
        across row groups), and read no footer."""
        with self._lock:
            furthest: dict[tuple[str, str], tuple[str, int, str, int]] = {}
            for key in self._columns:
                at = furthest.setdefault((key[0], key[2]), key)
                if (key[1], key[3]) > (at[1], at[3]):
                    furthest[key[0], key[2]] = key
            kept = set(furthest.values())
            for key in [key for key in self._columns if key not in kept]:
                self._bytes -= self._columns.pop(key).nbytes
            kept_groups = {key[:3] for key in kept}
            for key in [key for key in self._readers if key not in kept_groups]:
                del self._readers[key]

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._columns.clear()
            self._readers.clear()
            self._bytes = 0


GROUP_CACHE = GroupCache()


def unchecked_values(values: "pa.Array | pa.ChunkedArray | pa.Scalar") -> Any:
    """``values`` as Python values (a list for an array); a string that is not UTF-8 (neither
    its writer nor Parquet's reader checks) as its bytes, where ``as_py`` would raise (a
    struct's string fields too: a {bytes, path} cell's path, in ``batch.BatchEncoder``)."""
    import pyarrow as pa

    listed = isinstance(values, (pa.Array, pa.ChunkedArray))
    try:
        return values.to_pylist() if listed else values.as_py()
    except UnicodeDecodeError:
        raw_type = pa.large_binary()
        if pa.types.is_struct(values.type):
            raw_type = pa.struct([field.with_type(raw_type) if field.type in (
                pa.string(), pa.large_string()) else field for field in values.type])
        raw = values.cast(raw_type)
        return raw.to_pylist() if listed else raw.as_py()


def read_table_cell(path: str, cell: TableCell, stream: bool = False) -> bytes | str | BinaryIO:
    """A table cell's image: its bytes (with ``stream``, a file object over them that copies
    nothing, for header probes), or (a struct with only a path) the file it names."""
    import pyarrow as pa

    value = GROUP_CACHE.value(path, cell.group, cell.row, cell.column)
    if not value.is_valid:
        raise ValueError(f"row has no image (null {cell.column!r})")
    if isinstance(value, pa.DictionaryScalar):  # the dictionary's entry, never a decoded copy
        value = value.value
    data = value if image_column_kind(value.type) == "bytes" else value["bytes"]
    if data.is_valid:
        return pa.BufferReader(data.as_buffer()) if stream else data.as_py()
    named = unchecked_values(value["path"]) if value.type.get_field_index("path") >= 0 else None
    if isinstance(named, bytes):  # a binary path field (or not UTF-8): the name's own bytes
        named = os.fsdecode(named)
    if not named:
        raise ValueError(f"row has no image ({cell.column!r} holds neither bytes nor a path)")
    return cell_file(named, path, cell.path_roots)


def path_roots(folders) -> tuple[str, ...]:
    """``--table-paths-root`` folders as real paths; each must be an existing folder."""
    folders = list(folders)
    for folder in folders:
        if not os.path.isdir(folder):
            raise UsageError(f"--table-paths-root {folder}: not a folder")
    return tuple(os.path.realpath(folder) for folder in folders)


def cell_file(named: str, table: str, roots: tuple[str, ...] = ()) -> str:
    """The file a table's ``{bytes: null, path: named}`` cell may be read from (a relative one
    lies beside the table), or ``RefusedPathError``: resolved, it must lie in the table's folder
    or one of ``roots`` (real paths), have an image extension, and be a regular file."""
    if storage.local_path(table) is None:
        raise RefusedPathError(f"path cell {named!r}: a table in object storage must hold "
                               "the image bytes (path cells are read only beside local tables)")
    if storage.local_path(named) != named:  # else looked up as a folder ``s3:`` beside it
        raise RefusedPathError(f"path cell {named!r} is a URL: path cells name files by "
                               "their path (a table must hold the bytes of other images)")
    if "\0" in named:
        raise RefusedPathError(f"path cell {named!r} holds a NUL byte, which no file name holds")
    folder = os.path.dirname(os.path.abspath(table))
    candidate = os.path.join(folder, named)  # an absolute ``named`` stays as it is
    if not is_image_name(candidate):
        raise RefusedPathError(f"path cell {named!r} is not an image file name (.jpg, .png, ...)")
    real = os.path.realpath(candidate)
    allowed = (os.path.realpath(folder), *roots)
    if not any(os.path.commonpath([real, root]) == root for root in allowed):
        raise RefusedPathError(f"path cell {named!r} is outside the table's folder {folder} "
                               f"(it resolves to {real}); --table-paths-root DIR allows more")
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise RefusedPathError(f"path cell {named!r} is not a regular file ({real})")
    return candidate


# ----------------------------------------------------------------------------- reading items

def open_item(item: InputItem, stream: bool = False) -> str | bytes | BinaryIO:
    """What to decode for ``item``: a file path, the bytes of a container member or an object,
    or a file object over them (with ``stream``, for header probes, which close it; for a tar
    member over ``MEMBER_READ_BYTES``, always: it holds no open file, each refill reads anew)."""
    member = getattr(item, "member", None)
    if member is None:
        return item.path
    if isinstance(member, Fetched):
        return io.BytesIO(member.data) if stream else member.data
    if stream and held_key(item) is not None:  # a header probe in a store
        return _read_ahead(item)
    if (held := HELD.take(held_key(item))) is not None:  # a decode in the process that read ahead
        return held
    if isinstance(member, TarMember):
        if stream:
            return storage.open_range(item.path, member.offset, member.size)
        if member.size > MEMBER_READ_BYTES:
            return storage.open_range(item.path, member.offset, member.size,
                                      buffer_size=MEMBER_BUFFER_BYTES)
        return read_tar_member(item.path, member)
    if isinstance(member, TableCell):
        return read_table_cell(item.path, member, stream)
    if isinstance(member, StoredObject):
        return storage.read_object(item.path)
    if isinstance(member, Unreadable):
        raise DamagedContainerError(member.reason)
    raise TypeError(f"unknown member locator {member!r}")
