"""One in-memory input made ready for the engine (``api.Encoder``, ``batch.BatchEncoder``): what
to read of it (``image_source``), then its size, patch grid and patches, or why it failed, as
the error row's text (``prepare``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
from PIL import Image

from .. import storage
from ..tower.config import VisionConfig
from ..tower.transform import image_to_patches, no_pixels, plan_canvas
from .decode import decode_image, describe_error, patches_tensor, regular_only

if TYPE_CHECKING:
    import torch

#: What ``prepare`` takes, besides paths and bytes.
EXPECTED = "a PIL image, a uint8 array, a path, bytes or a {bytes, path} dict"


def image_source(image: Any) -> tuple[Any, str | None]:
    """What to read of one input, and its name (or None): a ``{"bytes", "path"}`` dict
    (``datasets``' ``Image(decode=False)``) gives its bytes, else its path, named by its path; a
    path gives and names its text; bytes-like input gives ``bytes``; anything else, itself."""
    if isinstance(image, Mapping):
        data, named = image.get("bytes"), image.get("path")
        if isinstance(named, bytes):  # a table's binary path field: the file name's own bytes
            named = os.fsdecode(named)
        name = os.fspath(named) if isinstance(named, (str, os.PathLike)) and named else None
        return (image_source(data)[0] if data is not None else
                image_source(named)[0] if named is not None else None), name
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        return path, path
    if isinstance(image, (bytearray, memoryview)):
        return bytes(image), None
    return image, None


@dataclass
class Prepared:
    """One input: its stored size (None where unknown), bf16 patches ``(n_h*n_w, 3*p*p)`` and
    the patch grid, or ``error``; ``key`` and ``index``: the caller's."""

    key: Any = None
    index: int = 0
    width: int | None = None
    height: int | None = None
    patches: "torch.Tensor | None" = None
    n_h: int = 0
    n_w: int = 0
    error: str | None = None
    wrong_type: bool = False  # the input is of a kind ``prepare`` does not take

    @property
    def tokens(self) -> int:
        return self.n_h * self.n_w

    def failed(self, error: str) -> "Prepared":
        """This input with ``error`` in place of its patches and grid (its size kept)."""
        self.error, self.patches, self.n_h, self.n_w = error, None, 0, 0
        return self


def array_to_image(array: np.ndarray) -> Image.Image:
    """A uint8 HxW, HxWx1, HxWx3 or HxWx4 array (or 16-bit grey) as a PIL image."""
    if array.dtype == np.uint16 and array.ndim == 2:
        return Image.fromarray(array)  # 16-bit gray: scaled to 8 bits like a 16-bit file
    if array.dtype != np.uint8:
        raise ValueError(f"array has dtype {array.dtype}; expected uint8 (HxW or HxWx3)")
    if array.ndim == 2 or (array.ndim == 3 and array.shape[2] == 1):
        return Image.fromarray(np.ascontiguousarray(array.reshape(array.shape[:2])), "L")
    if array.ndim == 3 and array.shape[2] in (3, 4):
        return Image.fromarray(np.ascontiguousarray(array), "RGBA"[:array.shape[2]])  # RGB(A)
    raise ValueError(f"array has shape {tuple(array.shape)}; expected HxW, HxWx1, HxWx3 or "
                     "HxWx4")


def prepare(source: Any, cfg: VisionConfig, max_pixels: int, item: Prepared) -> Prepared:
    """``item`` with ``source`` (what ``image_source`` gives) read, its size and grid checked
    first (a path or bytes: in its one decode; an object in a store read once), then
    transformed. A broken input of any kind is ``item``'s error, never an exception."""
    try:
        if isinstance(source, (str, bytes)):
            decoded = decode_image(regular_only(storage.whole_if_stored(source)), cfg, max_pixels)
            item.width, item.height = decoded.width, decoded.height  # an error row keeps them
            if decoded.error is not None:
                return item.failed(decoded.error)
            item.patches, item.n_h, item.n_w = patches_tensor(decoded), decoded.n_h, decoded.n_w
            return item
        if isinstance(source, Image.Image):
            item.width, item.height = source.size
        elif isinstance(source, np.ndarray) and source.ndim in (2, 3):  # else no image's shape
            item.height, item.width = source.shape[:2]
        if item.width is not None:
            if (error := no_pixels(item.width, item.height)) is not None:
                return item.failed(error)
            plan_canvas(item.width, item.height, cfg)  # no canvas: the error before the transform
        if isinstance(source, np.ndarray):
            source = array_to_image(source)
        if not isinstance(source, Image.Image):
            item.wrong_type = True
            return item.failed(f"TypeError: unsupported input {type(source).__name__} "
                               f"(expected {EXPECTED})")
        item.patches, canvas = image_to_patches(source, cfg)
        item.n_h, item.n_w = canvas.n_h, canvas.n_w
    except Exception as exc:  # a broken image object is this item's error, not the run's
        item.failed(describe_error(exc))
    return item
