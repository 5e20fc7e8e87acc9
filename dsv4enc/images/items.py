"""What one input is: an ``InputItem`` (its output key, the path the decoder opens, and a
locator for an image inside a container or a store), and which names are image names.
``discover`` and ``sources`` build on this module, which imports neither."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .formats import EXTENSION_FORMATS

IMAGE_EXTENSIONS = frozenset(EXTENSION_FORMATS)  # each opened only as its own format


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True, slots=True)
class TarMember:
    """An image inside a tar shard: the member's name, and where its data lies in the file."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class TableCell:
    """An image in a table: ``column``'s cell at ``row`` of row group (or record batch)
    ``group``; ``path_roots``: more folders (real paths) its ``{bytes: null, path}`` may name."""

    column: str
    group: int
    row: int
    path_roots: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A whole object in a store (``InputItem.path``, and ``name`` for its format, are its URL;
    ``size`` as listed, None for a ``--files-from`` line): its probe's bytes, all of a small
    one, are held for the decode."""

    name: str
    size: int | None


@dataclass(frozen=True, slots=True)
class Fetched:
    """An input's bytes, read already (a small object's header read, a tar shard's streamed
    member, a table cell in a store read for its probe), carried by its decode task; ``name``:
    the replaced locator's; ``cell``: the table cell replaced, whose row's kept columns are
    still read from the table (a Ray actor writes the rows of the items it was sent)."""

    name: str | None
    data: bytes = field(repr=False)
    cell: TableCell | None = None


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A part of a container that cannot be read: its error row says ``reason``."""

    reason: str


@dataclass(frozen=True, slots=True)  # one per input of a listing of millions: no __dict__
class InputItem:
    """One image to encode: ``key`` is the output name, ``path`` what the decoder opens;
    ``member`` locates it in a container (``TarMember``, ``TableCell``), in a store
    (``StoredObject``), marks a damaged part (``Unreadable``) or carries its bytes (``Fetched``);
    None for a plain image file. ``sources.open_item`` reads it. ``sidecars``: the text of its
    tar sample's kept members (``--keep-member``), as ``(extension, text)`` pairs."""

    key: str
    path: str
    member: TarMember | TableCell | StoredObject | Fetched | Unreadable | None = None
    sidecars: tuple[tuple[str, str], ...] = ()
