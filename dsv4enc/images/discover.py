"""Finding the images to encode: folders and prefixes (recursive, sorted), files, containers
and path lists, each keyed as the output's ``path`` column holds it (docs/inputs.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterable, Iterator, Protocol, Sequence

from .. import storage
from ..columns import OUTPUT_COLUMNS, utf8_text
from ..errors import UsageError
from .items import InputItem, TableCell, is_image_name
from .sources import (NoImageColumn, StoredObject, container_kind, expand_table, expand_tar,
                      path_roots, refuse_compressed_tar, sidecar_fields, table_fields,
                      written_by_dsv4enc)

_log = logging.getLogger("dsv4enc")


class Stop(Protocol):
    """What discovery asks of the run's signal handling (``run/stopping.StopSignals``)."""

    def requested(self) -> bool:
        """A signal arrived: end the walk early."""

    def check(self) -> None:
        """Raise the run's ``errors.Interrupted`` if a signal arrived."""


@dataclass
class Discovery:
    """Items in input order, the non-image files passed over, the folders not listed
    (``(folder, reason)``: missing from the run), the tables and tar shards read, and the input
    columns the rows carry (``pyarrow`` fields of ``--keep-column``, ``--key-column``,
    ``--keep-member``)."""

    items: list[InputItem] = field(default_factory=list)
    skipped: int = 0
    tables: int = 0
    shards: int = 0
    kept_fields: list = field(default_factory=list)
    unlisted: list[tuple[str, str]] = field(default_factory=list)
    listed: bool = False  # the listing has ended (every input found; the counts are final)


@dataclass(frozen=True)
class Exclusions:
    """The entries a folder's (or a prefix's) walk leaves out: hidden ones (a name starting
    with ``.``: ``.git``, ``.DS_Store``, the macOS ``._*`` resource files), and those an
    ``--exclude`` glob matches by name or by path under the walked folder (``fnmatchcase``:
    ``*`` matches ``/`` too). A left-out folder is not walked."""

    globs: tuple[str, ...] = ()
    #: The run's own output (``--out``, and the parts folder beside a single file): never an
    #: input, though it may sit in an input folder.
    outputs: tuple[str, ...] = ()

    def skips(self, name: str, rel: str) -> bool:
        """Whether the entry ``name``, at ``rel`` under the walked folder, is left out."""
        return name.startswith(".") or any(fnmatchcase(name, glob) or fnmatchcase(rel, glob)
                                           for glob in self.globs)

    def under(self, root: str) -> Callable[[str, str], bool]:
        """``skips`` for the walk of ``root``, which also leaves out the ``outputs`` below it."""
        prefix = _compared(root).rstrip("/") + "/"
        below = {path[len(prefix):] for path in map(_compared, self.outputs)
                 if path.startswith(prefix)}
        return (lambda name, rel: rel in below or self.skips(name, rel)) if below else self.skips


def _compared(location: str) -> str:
    """``location`` as paths are compared: a local one resolved, a URL without its last slash."""
    local = storage.local_path(location)
    return os.path.realpath(local) if local is not None else location.rstrip("/")


def iter_folder(root: str | Path, found: "Discovery",
                should_stop: Callable[[], bool] | None = None,
                containers: list[tuple[str, str]] | None = None,
                exclusions: Exclusions = Exclusions()) -> Iterator[InputItem]:
    """Image files under the folder or prefix ``root`` as ``storage.walk`` reaches them, keyed
    relative to it (an object in a store is a ``StoredObject``). Folders not listed go to
    ``found.unlisted`` as ``(path, reason)``, containers to ``containers`` (when given) as
    ``(path relative to root, path)``, other files count in ``found.skipped``. ``should_stop``
    is polled once per entry: when it turns true, the walk ends."""
    for entry in storage.walk(str(root), exclusions.under(str(root)), found.unlisted,
                              should_stop):
        if is_image_name(entry.key):
            member = StoredObject(entry.url, entry.size) if entry.size is not None else None
            yield InputItem(key=entry.key, path=entry.url, member=member)
        elif containers is not None and container_kind(entry.key) is not None:
            containers.append((entry.key, entry.url))
        else:
            found.skipped += 1


#: The longest line a ``--files-from`` list may hold: a path is at most 4 KiB on Linux, a URL
#: rarely over 8 KiB, so a longer line means the file is no list (a binary, ``/dev/zero``).
MAX_LIST_LINE_BYTES = 64 << 10


def read_path_list(list_file: str, stop: Stop | None = None) -> Iterator[str]:
    """The paths of a path list (``-``: standard input) as its lines are read, stripped; blank
    lines and lines starting with ``#`` are skipped (``./#name`` names a file ``#name``), and
    a UTF-8 byte order mark before the first. An unreadable list, a device, UTF-16 text or a
    line over ``MAX_LIST_LINE_BYTES`` is a UsageError; ``stop`` is checked once a line (a list
    can be a pipe that never ends)."""
    where = "standard input" if list_file == "-" else list_file
    try:
        with _open_path_list(list_file) as handle:
            number = 0
            # At most one byte over the limit a line: memory stays bounded whatever the file holds.
            while line := handle.readline(MAX_LIST_LINE_BYTES + 1):
                if isinstance(line, str):  # a text stdin (no buffer)
                    line = os.fsencode(line)
                number += 1
                if len(line.rstrip(b"\r\n")) > MAX_LIST_LINE_BYTES:
                    raise UsageError(f"--files-from {where}: line {number} is longer than "
                                     f"{MAX_LIST_LINE_BYTES} bytes, so this is no list of paths "
                                     "(one path a line)")
                if stop is not None:
                    stop.check()
                if number == 1:  # the byte order mark a Windows editor saves a list with
                    if line.startswith((b"\xff\xfe", b"\xfe\xff")):  # its paths would be NULs
                        raise UsageError(f"--files-from {where}: the list is UTF-16 text (as "
                                         "Windows PowerShell's > writes it); save it as UTF-8, "
                                         "one path a line")
                    line = line.removeprefix(b"\xef\xbb\xbf")
                path = os.fsdecode(line).strip()  # any bytes go through, as the file system's
                if path and not path.startswith("#"):
                    yield path
    except OSError as exc:  # opening or reading the list
        raise UsageError(f"cannot read --files-from {list_file}: {exc.strerror or exc}") from None


def _open_path_list(list_file: str) -> ContextManager[BinaryIO]:
    """The list's file, read as bytes: standard input (left open) for ``-``, a regular file or a
    pipe; a device (``/dev/zero``, a terminal, standard input that is one: nothing piped in)
    is refused, as reading it may never end."""
    if list_file == "-":
        if sys.stdin is not None and sys.stdin.isatty():
            raise UsageError("--files-from -: standard input is a terminal, not a list of paths "
                             "(pipe a list in, or give a file)")
        return contextlib.nullcontext(getattr(sys.stdin, "buffer", sys.stdin))
    if stat.S_ISCHR(mode := os.stat(list_file).st_mode) or stat.S_ISBLK(mode):
        raise UsageError(f"--files-from {list_file}: a device, not a list of paths (give a "
                         "file or a pipe, or - for standard input)")
    return open(list_file, "rb")


def discover(inputs: Iterable[str], files_from: str | None = None,
             image_column: str | None = None, key_column: str | None = None,
             stop: Stop | None = None, table_paths_roots: Iterable[str] = (),
             keep_columns: Sequence[str] = (), keep_members: Sequence[str] = (),
             exclude: Sequence[str] = (), outputs: Sequence[str] = ()) -> Discovery:
    """``stream_inputs``' items at once, in ``Discovery.items``."""
    found = Discovery()
    found.items = list(stream_inputs(found, inputs, files_from, image_column, key_column,
                                     stop, table_paths_roots, keep_columns, keep_members,
                                     exclude, outputs))
    return found


def stream_inputs(found: Discovery, inputs: Iterable[str], files_from: str | None = None,
                  image_column: str | None = None, key_column: str | None = None,
                  stop: Stop | None = None, table_paths_roots: Iterable[str] = (),
                  keep_columns: Sequence[str] = (), keep_members: Sequence[str] = (),
                  exclude: Sequence[str] = (), outputs: Sequence[str] = ()
                  ) -> Iterator[InputItem]:
    """Expand folders and files (and an optional path list) into items, in input order, as
    the listing reaches them: each input examined once, a folder or a prefix walked
    (``iter_folder``), a path list line by line (``_list_items``), a container indexed when
    reached; keys made unique (``UniqueKeys``). ``found`` (its ``items`` left alone) counts what
    was passed over and the tables read, gathers the folders not listed (logged at the end),
    and at the end holds ``kept_fields`` and ``listed``. ``outputs``: the run's own output,
    which no walk lists (``Exclusions.outputs``).

    A missing input is a UsageError before the first item; so is an input set with nothing in
    it, at the end. Paths from ``--files-from`` are taken as given (a missing one is an error
    row later). When ``stop`` records a signal, ``errors.Interrupted`` is raised."""
    places = []
    for raw in inputs:
        place = storage.examine(raw)
        check_path_input(place)
        places.append(place)
    state = _Listing(found, UniqueKeys(), path_roots(table_paths_roots),
                     (image_column, key_column), tuple(keep_members),
                     Exclusions(tuple(exclude), tuple(outputs)))
    prefix_roots = sum(place.remote or place.kind == "folder"  # see ``key_under_root``
                       for place in places) > 1
    for place in places:
        if stop is not None:
            stop.check()
        for item in _input_items(place, state, prefix_roots, stop):
            yield state.keyed(item)
    if files_from is not None:
        yield from _list_items(files_from, state, stop)
    _end_listing(state, keep_columns, stop)


def _list_items(list_file: str, state: _Listing, stop: Stop | None) -> Iterator[InputItem]:
    """The items of a ``--files-from`` list as its lines are read: an image name (not a folder),
    a container's images (keyed under the line as given); other lines count as skipped. Until a
    listed path exists (or is a URL) the items are held back: a list of none is refused."""
    missing: MissingPaths | None = MissingPaths()  # None once a listed path exists
    held: list[InputItem] = []
    folder_named = False
    for line in read_path_list(list_file, stop):
        state.name(line)
        path = storage.read_at(line)  # where it is read; ``line`` stays its key
        if missing is not None and (storage.local_path(line) is None or os.path.lexists(path)):
            missing = None
            yield from held
            held.clear()
        elif missing is not None:
            missing.add(line)
        refuse_compressed_tar(line)  # as given by name (not passed over as no image)
        container = container_kind(line) is not None
        folder = os.path.isdir(path)  # False on errors (a name too long, say)
        if folder and not folder_named:  # left out as no image: said once, whatever -q
            folder_named = True
            _log.error("--files-from %s: %s is a folder; a list's lines are read as files, a "
                       "folder is not walked (its images, and those of any other folder "
                       "listed, are not in this run): give folders as inputs", list_file,
                       printable(line)[:300])
        if not (is_image_name(line) or container) or folder:
            state.found.skipped += 1
            continue
        # an object's line is read from its store, as when given by name (no size: not listed)
        member = StoredObject(path, None) if storage.reads_are_requests(path) else None
        items = state.container(path, line) if container else [InputItem(line, path, member)]
        keyed = [state.keyed(item) for item in items]
        if missing is None:
            yield from keyed
        else:
            held.extend(keyed)
    if missing is not None and missing.count:
        refuse_missing_list(list_file, missing)


def check_path_input(place: storage.Found) -> None:
    """Refuse an input that cannot be read before anything is listed: a missing path or
    object, a folder that cannot be listed, a compressed tar, a FIFO, socket or device
    without an image name, a link without one that leads nowhere (an image's or a
    container's is its error row)."""
    raw = place.location
    if place.kind == "missing":
        if (reason := _cannot_look(place)) is not None:  # there, behind a closed folder
            raise UsageError(f"cannot read input {printable(raw)}: {reason}")
        raise UsageError(f"input not found: {printable(raw)}")
    if place.kind == "folder" and (reason := _cannot_look(place)) is not None:
        raise UsageError(f"cannot list input folder {printable(raw)}: {reason}")
    if place.regular:
        refuse_compressed_tar(raw)
    elif place.kind == "file" and not place.link and not is_image_name(raw):
        raise UsageError(f"input {printable(raw)} is not a regular file or a folder")
    elif place.link and not is_image_name(raw) and container_kind(raw) is None:
        try:  # a folder behind a link that leads nowhere (a share not mounted, a loop)
            os.stat(place.path)
        except OSError as exc:
            raise UsageError(f"input {printable(raw)} is a symbolic link to "
                             f"{printable(os.readlink(place.path))}, which cannot be read "
                             f"({exc.strerror or exc})") from None


def _cannot_look(place: storage.Found) -> str | None:
    """Why the local input ``place`` cannot be looked at (a folder on its way that the user
    may not enter, a folder they may not list), or None (it is not there, or is a URL)."""
    if place.remote:
        return None
    try:
        if place.kind == "folder":
            with os.scandir(place.path):
                pass
        else:
            os.lstat(place.path)
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL byte
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@dataclass
class _Listing:
    """What ``stream_inputs`` keeps while it lists; the counts of inputs named (files, objects,
    list lines), walked (folders, prefixes: an empty one is a warning, not an error) and items."""

    found: Discovery
    keys: "UniqueKeys"
    roots: tuple[str, ...]
    columns: tuple[str | None, str | None]
    members: tuple[str, ...] = ()
    exclusions: Exclusions = Exclusions()
    tables: dict = field(default_factory=dict)
    named: int = 0
    walked: int = 0
    items: int = 0
    shown: list[str] = field(default_factory=list)  # the first names given, for a message

    def name(self, raw: str) -> None:
        self.named += 1
        if len(self.shown) < 3:
            self.shown.append(raw)

    def keyed(self, item: InputItem) -> InputItem:
        self.items += 1
        if isinstance(item.member, TableCell):
            self.tables.setdefault(item.path)
        return self.keys.unique(item)

    def container(self, path: str, name: str) -> list[InputItem]:
        """The images of the container ``path`` under ``name``, counted in ``found``."""
        # a table in a store reads no path cell (``sources.cell_file``): roots are for local ones
        items, skipped = container_items(path, name, *self.columns, self.roots, self.members)
        self.found.skipped += skipped
        self.found.tables += container_kind(path) == "table"
        self.found.shards += container_kind(path) == "tar"
        return items


def _input_items(place: storage.Found, state: _Listing, prefix_roots: bool,
                 stop: Stop | None) -> Iterator[InputItem]:
    """The items of one input as found (keys not yet unique across inputs): a file or object is
    an image or a container, keyed as given (read at ``place.path``: a ``file://`` input's
    local path); a folder or prefix is walked, then ``read_folder_containers``."""
    found, raw = state.found, place.location
    if place.kind == "file":
        state.name(raw)
        if container_kind(raw) is not None and (place.regular or place.link):
            yield from state.container(place.path, raw)  # a bad link: its error row, as in a folder
        elif is_image_name(raw):  # a file, a link, or a FIFO/socket/device (its row says so)
            member = StoredObject(raw, place.size) if place.size is not None else None
            yield InputItem(key=raw, path=place.path, member=member)
        else:
            found.skipped += 1
        return
    state.walked += 1
    shards: list[tuple[str, str]] = []
    images = 0
    root = place.posix if prefix_roots and place.posix != "." else None
    should_stop = stop.requested if stop is not None else None
    for item in iter_folder(place.path, found, should_stop, shards, state.exclusions):
        images += 1
        yield item if root is None else replace(item, key=key_under_root(root, item.key))
    if stop is not None:
        stop.check()  # a walk cut short is not read for containers
    yield from read_folder_containers(raw, shards, images > 0, state, root)


def _end_listing(state: _Listing, keep_columns: Sequence[str], stop: Stop | None) -> None:
    """The checks once every input is listed, then the unlisted folders logged."""
    found = state.found
    image_column, key_column = state.columns
    if not found.tables and (image_column is not None or key_column is not None or keep_columns):
        flag = ("--image-column" if image_column is not None else
                "--key-column" if key_column is not None else "--keep-column")
        hint = ("; a .tar shard's sidecar members (.txt, .json, .cls) are kept with "
                "--keep-member" if found.shards and flag == "--keep-column" else "")
        raise UsageError(f"{flag} applies to Parquet/Arrow inputs, and none was given{hint}")
    if state.members and not found.shards:
        raise UsageError("--keep-member applies to WebDataset .tar shards, and none was given")
    found.kept_fields = kept_fields(list(state.tables), keep_columns, key_column, state.members)
    if stop is not None:
        stop.check()
    if state.named and not state.walked and not state.items:
        more = state.named - len(state.shown)
        shown = ", ".join(state.shown) + (f" and {more} more" if more > 0 else "")
        raise UsageError(f"no image in the inputs given ({shown}): dsv4enc reads image files "
                         "(.jpg, .jpeg, .png, .webp, .bmp, .gif, .tif, .tiff), .tar shards and "
                         ".parquet/.arrow/.feather tables")
    warn_unlisted(found.unlisted)
    found.listed = True


def kept_fields(tables: Sequence[str], keep_columns: Sequence[str], key_column: str | None,
                keep_members: Sequence[str] = ()) -> list:
    """The fields of the input columns the rows carry (``tables``: the table files read):
    ``keep_columns`` (an output column's name is refused), then ``key_column`` in its own type
    unless kept already or named like an output column (its text is in ``path`` anyway), then
    the sidecar members ``keep_members`` as strings (a kept column's name is refused)."""
    if not keep_columns and key_column is None and not keep_members:
        return []
    for name in keep_columns:
        if name in OUTPUT_COLUMNS:
            raise UsageError(f"--keep-column {name}: the output has a {name!r} column of its "
                             "own; rename the table's column to keep it")
    names = list(dict.fromkeys(keep_columns))
    if key_column is not None and key_column not in names and key_column not in OUTPUT_COLUMNS:
        names.append(key_column)
    for ext in keep_members:
        if ext in names:
            raise UsageError(f"--keep-member {ext}: a kept table column is named {ext!r} too; "
                             "keep one of them")
    return [*(table_fields(list(tables), names) if names else []), *sidecar_fields(keep_members)]


@dataclass
class MissingPaths:
    """The paths of a ``--files-from`` list read while none of them exists: how many, the first
    one and the first relative one (what ``refuse_missing_list`` names)."""

    count: int = 0
    first: str = ""
    relative: str | None = None

    def add(self, path: str) -> None:
        self.count += 1
        self.first = self.first or path
        if self.relative is None and not os.path.isabs(path):
            self.relative = path


def printable(path: str) -> str:
    """``path`` as an error line shows it: an unprintable character (a control character, a
    non-UTF-8 byte held as a surrogate) as its escape (``\\x15``), never raw bytes."""
    return "".join(char if char.isprintable() else _escaped(char) for char in path)


def _escaped(char: str) -> str:
    if 0xDC80 <= ord(char) <= 0xDCFF:  # os.fsdecode's stand-in for an undecodable byte
        return f"\\x{ord(char) - 0xDC00:02x}"
    return char.encode("unicode_escape").decode("ascii")


def refuse_missing_list(list_file: str, missing: MissingPaths) -> None:
    """The UsageError for a ``--files-from`` list not one of whose paths exists (the likely
    cause: relative paths are taken from the current folder, not the list's)."""
    where = "standard input" if list_file == "-" else printable(list_file)
    first = printable(missing.first)
    text = ("no image could be read: " + (
        f"none of the {missing.count} paths in --files-from {where} exists (e.g. {first})"
        if missing.count > 1 else
        f"the path in --files-from {where} does not exist ({first})"))
    if missing.relative is not None:
        here = os.getcwd()
        text += f"; relative paths are taken from the current folder ({printable(here)})"
        beside = os.path.dirname(os.path.abspath(list_file)) if list_file != "-" else here
        if beside != here:
            text += f", not from the list's folder ({printable(beside)})"
            if os.path.lexists(os.path.join(beside, missing.relative)):
                text += ", where they are: run dsv4enc there, or list absolute paths"
    raise UsageError(text)


def container_items(raw: str, name: str, image_column: str | None = None,
                    key_column: str | None = None, roots: tuple[str, ...] = (),
                    keep_members: Sequence[str] = ()) -> tuple[list[InputItem], int]:
    """The images of the container ``raw`` keyed under ``name`` (its path as given, or under its
    folder), and the entries passed over; a key repeated inside it gets ``#2``, ``#3``, ... in
    its order: it depends on the container alone. Every way of finding a container calls this."""
    if container_kind(raw) == "tar":
        items, skipped = expand_tar(raw, name, keep_members)
    else:
        items, skipped = expand_table(raw, image_column, key_column, roots, name), 0
    return unique_keys(items), skipped


def read_folder_containers(raw: str, containers: list[tuple[str, str]], has_images: bool,
                           state: _Listing, root: str | None) -> Iterator[InputItem]:
    """The images of the containers (``(relative path, path)``) found in the folder or prefix
    ``raw``: read when it holds no image file, else passed over with a warning; so is a table
    without the image column (``NoImageColumn``), and an output of dsv4enc, without one."""
    if has_images and containers:
        state.found.skipped += len(containers)
        _log.warning("%s: %d .tar shards or tables beside its images are not read (a folder with "
                     "images is read for its images); pass them by name to encode them (e.g. %s)",
                     raw, len(containers), containers[0][1])
        return
    imageless: list[str] = []  # tables of metadata beside the shards (img2dataset's)
    for rel, path in containers:
        if written_by_dsv4enc(path):  # an output (or its parts) written beside the shards
            state.found.skipped += 1
            continue
        try:
            yield from state.container(path, key_under_root(root, rel))
        except NoImageColumn:
            state.found.skipped += 1
            imageless.append(path)
    if imageless:
        _log.warning("%s: %d tables without a column of images are not read (e.g. %s)", raw,
                     len(imageless), imageless[0])


def nothing_found(inputs: Iterable[str], files_from: str | None, skipped: int) -> str:
    """The line that says a run found no image: its folders held none (and no container)."""
    where = ", ".join(inputs) or files_from
    return (f"no images found in {where} ({skipped} other files skipped); the output will "
            "have no rows")


def warn_unlisted(unlisted: list[tuple[str, str]], shown: int = 10) -> None:
    """One line per folder that could not be listed (the first ``shown``), logged as an
    error so that ``--quiet`` shows it too: images are missing from the run."""
    for folder, reason in unlisted[:shown]:
        _log.error("cannot list folder %s (%s): its images are not in this run",
                   printable(os.fsdecode(folder))[:300], reason)
    if len(unlisted) > shown:
        _log.error("%d more folders could not be listed", len(unlisted) - shown)


# ----------------------------------------------------------------------------- keys
# Keys are unique within an output (one ``path`` per row; ``--resume`` matches parts by them).
# An image in a folder is keyed by its path under it, prefixed with the folder as given when
# several are (``key_under_root``); a key still taken by an earlier item (a file given twice,
# a tar's repeated member name, two shards' same sample key, a non-UTF-8 name whose escaped
# text is another file's name) gets ``#2``, ``#3``, ... (``unique_keys``).


def key_under_root(root: str | None, key: str) -> str:
    """``key`` (a path under a walked folder) under ``root``, the folder given in posix form
    (``storage.Found.posix``), when several are."""
    return key if root is None else f"{root}/{key}"


def _output_text(key: str) -> str:
    """``key`` as the output's ``path`` column holds it (``columns.utf8_text``)."""
    return key if key.isascii() else utf8_text(key)  # ASCII, once per key of millions: no encode


def unique_keys(items: list[InputItem]) -> list[InputItem]:
    """``items`` with unique keys (``UniqueKeys``), numbered past every key of the list."""
    texts = [_output_text(item.key) for item in items]
    taken = set(texts)
    if len(taken) == len(texts):
        return items
    keys = UniqueKeys(taken)
    return [keys.unique(item, text) for item, text in zip(items, texts)]


class UniqueKeys:
    """Keys made unique as items come: the first with a key keeps it, a later one gets ``KEY#2``,
    ``KEY#3``, ... (the first not taken by an earlier item or ``taken``); one text held per key."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.taken = set() if taken is None else taken
        self.seen: set[str] = set()
        self.next_number: dict[str, int] = {}

    def unique(self, item: InputItem, text: str | None = None) -> InputItem:
        """``item``, renamed ``KEY#N`` if an earlier item had its key."""
        text = _output_text(item.key) if text is None else text
        if text in self.seen:
            number = self.next_number.get(text, 2)
            while f"{text}#{number}" in self.taken or f"{text}#{number}" in self.seen:
                number += 1
            self.next_number[text] = number + 1
            item = replace(item, key=f"{item.key}#{number}")
            text = f"{text}#{number}"
            self.taken.add(text)
        self.seen.add(text)
        return item
