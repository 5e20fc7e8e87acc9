"""What one input is: an ``InputItem`` (its output key, the path the decoder opens, and a
locator for an image inside a container or a store), and which names are image names.
``discover`` and ``sources`` build on this module, which imports neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .formats import EXTENSION_FORMATS

IMAGE_EXTENSIONS = frozenset(EXTENSION_FORMATS)  # each opened only as its own format


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class TarMember:
    """An image inside a tar shard: the member's name, and where its data lies in the file."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class TableCell:
    """An image in a table: ``column``'s cell at ``row`` of row group (Parquet) or record
    batch (Arrow) ``group``. ``path_roots``: folders (real paths) besides the table's own that
    a ``{bytes: null, path}`` cell may name files in."""

    column: str
    group: int
    row: int
    path_roots: tuple[str, ...] = ()


@dataclass(frozen=True)
class StoredObject:
    """An image that is a whole object in a store (``InputItem.path`` is its URL; ``name``
    too, for the format it stands for; ``size`` as listed). Its probe's first bytes, all of a
    small one, are held for the decode (``sources.HeldInputs``), else the decode reads it."""

    name: str
    size: int


@dataclass(frozen=True)
class Fetched:
    """An input's bytes, read already (a small object's header read, a tar shard's streamed
    member), carried by its decode task; ``name``: the replaced locator's."""

    name: str | None
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class Unreadable:
    """A part of a container that cannot be read: its one error row says ``reason``
    (``sources.DamagedContainerError``)."""

    reason: str


@dataclass(frozen=True)
class InputItem:
    """One image to encode: ``key`` is the output name, ``path`` what the decoder opens.
    ``member`` locates the image inside a container file ``path`` (``TarMember``,
    ``TableCell``), marks ``path`` as an object in a store (``StoredObject``) or a container's
    damaged part (``Unreadable``), or carries its bytes (``Fetched``, in a decode task); None
    for a plain image file. ``sources.open_item`` reads it."""

    key: str
    path: str
    member: TarMember | TableCell | StoredObject | Fetched | Unreadable | None = None
