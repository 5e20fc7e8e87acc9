"""The image formats dsv4enc reads, and opening an image only as one of them.

Pillow recognizes some forty formats by content; some hand the data to another program (EPS
to Ghostscript), many are rarely met and little hardened (TGA, SGI, PCX, DDS, ICO, QOI, ...).
So ``open_image`` opens a file only as JPEG, PNG, WebP, BMP, GIF or TIFF: its extension's
format first, else what its content is among the six (a JPEG named ``.png``, common in
scraped datasets: ``misnamed`` says so); unnamed bytes may be any. Other content is an error
that names its format; no other format's reader is ever started."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import IO, Any

DEFAULT_MAX_PIXELS = 89_478_485  # Pillow's own MAX_IMAGE_PIXELS: larger images are refused
DEFAULT_DECODE_TIMEOUT_S = 120.0  # one image's decode, or its header read, before it is given up

#: Accepted file extensions (lower case) and the Pillow format each stands for.
EXTENSION_FORMATS: dict[str, str] = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".bmp": "BMP",
    ".gif": "GIF", ".tif": "TIFF", ".tiff": "TIFF",
}
#: Every format dsv4enc opens: what unnamed bytes may be.
ACCEPTED_FORMATS: tuple[str, ...] = tuple(sorted(set(EXTENSION_FORMATS.values())))

_PREFIX_BYTES = 16  # what Pillow itself hands each format's content check


def formats_for(name: str | None) -> tuple[str, ...]:
    """The formats tried first for a file called ``name``: its extension's, else all accepted."""
    fmt = EXTENSION_FORMATS.get(os.path.splitext(name or "")[1].lower())
    return (fmt,) if fmt is not None else ACCEPTED_FORMATS


def image_name(source: Any, handle: Any) -> str | None:
    """The name whose extension decides the formats for ``handle`` (what is opened for
    ``source``): the file opened, else a tar member's name; None for unnamed bytes."""
    if isinstance(handle, (str, os.PathLike)):
        return os.fsdecode(handle)
    return getattr(getattr(source, "member", None), "name", None)


def _prefix(handle: str | os.PathLike | IO[bytes]) -> bytes | None:
    """``handle``'s first bytes (None: a path that is not a regular file)."""
    if isinstance(handle, (str, os.PathLike)):
        # Non-blocking: the path may have become a FIFO since Pillow opened it.
        fd = os.open(handle, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as file:
            return file.read(_PREFIX_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    handle.seek(0)
    prefix = handle.read(_PREFIX_BYTES)
    handle.seek(0)
    return prefix


def detected_format(prefix: bytes | None) -> str | None:
    """The Pillow format whose content check accepts an image's first bytes, if any. Only the
    checks run (a few byte comparisons): no format's reader is started."""
    from PIL import Image

    if not prefix:
        return None
    Image.init()
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        with contextlib.suppress(Exception):  # a check that needs more bytes than a short file has
            result = accept(prefix) if accept is not None else False
            if result and not isinstance(result, str):  # a str is Pillow's "maybe, but" warning
                return fmt
    return None


#: Formats Pillow reports for an image opened as one of the accepted formats: a JPEG with
#: several pictures (a camera's MPO) is opened by the JPEG reader.
_OPENED_AS = {"MPO": "JPEG"}


def misnamed(image, name: str | None) -> str | None:
    """The format ``image`` (opened by ``open_image`` for ``name``) is, when its name stands for
    another (a JPEG named ``.png``: ``"JPEG"``); else None."""
    allowed = formats_for(name)
    actual = _OPENED_AS.get(image.format, image.format)
    return actual if len(allowed) == 1 and actual not in allowed else None


def open_image(handle: str | os.PathLike | IO[bytes], name: str | None):
    """``PIL.Image.open(handle)`` restricted to the accepted formats, ``name``'s first. Else
    ``PIL.UnidentifiedImageError``, saying so for an empty file and naming a known format."""
    from PIL import Image, UnidentifiedImageError

    allowed = formats_for(name)
    others = [fmt for fmt in ACCEPTED_FORMATS if fmt not in allowed]
    for formats in (list(allowed), others):  # others: whatever the name says
        if formats:
            with contextlib.suppress(UnidentifiedImageError):
                try:
                    return Image.open(handle, formats=formats)
                except OSError as exc:  # libwebp's words for WebP data it cannot read
                    if str(exc) == "could not create decoder object":
                        raise OSError("damaged or cut-short WebP data (libwebp cannot read it)")
                    raise
    prefix = _prefix(handle)
    if prefix == b"":
        raise UnidentifiedImageError("empty file (0 bytes)")
    wanted = f"only {', '.join(ACCEPTED_FORMATS)} are read"
    if looks_like_tga(handle, prefix or b""):
        raise UnidentifiedImageError(f"the image is a TGA (Truevision Targa) file{_named(name)}"
                                     f" ({wanted})")
    actual = detected_format(prefix) or _heif_format(prefix or b"")
    if actual in ACCEPTED_FORMATS:  # not that its format is not read: its header is damaged
        raise UnidentifiedImageError(f"cannot read the image: it starts as {actual} data, but "
                                     "its header is damaged or cut short")
    if actual is None:  # no image at all
        raise UnidentifiedImageError(f"cannot identify the image ({wanted})")
    raise UnidentifiedImageError(f"the image looks like {actual} data{_named(name)} ({wanted})")


#: Brands of an ISO media file's ``ftyp`` box that make it a HEIF still image (an iPhone's HEIC
#: photo), which Pillow has no reader for; a video (MP4, MOV) has other brands.
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1",
                          b"msf1"})


def _heif_format(prefix: bytes) -> str | None:
    """``"HEIF (HEIC)"`` when an image's first bytes are a HEIF file's (a phone's photo saved
    under an image name): its error row names it, as Pillow's check names an AVIF."""
    return "HEIF (HEIC)" if prefix[4:8] == b"ftyp" and prefix[8:12] in _HEIF_BRANDS else None


def _named(name: str | None) -> str:
    """``, not the PNG its name says``: what the name of a misnamed file claims."""
    allowed = formats_for(name)
    return f", not the {allowed[0]} its name says" if len(allowed) == 1 else ""


_TGA_FOOTER = b"TRUEVISION-XFILE.\0"  # the last 18 bytes of a TGA 2.0 file
_TGA_IMAGE_TYPES = frozenset({1, 2, 3, 9, 10, 11})  # colour-mapped, true-colour, grey; RLE
_TGA_DEPTHS = frozenset({1, 8, 15, 16, 24, 32})


def looks_like_tga(handle: str | os.PathLike | IO[bytes], prefix: bytes) -> bool:
    """Whether ``handle`` (whose first bytes are ``prefix``) is a TGA image. TGA has no
    signature at its start (its first bytes can pass for a Windows cursor), so the 2.0
    footer decides; without one, the 18-byte header must hold a TGA's field values."""
    if len(prefix) < _PREFIX_BYTES:
        return False
    if isinstance(handle, (str, os.PathLike)):
        with open(handle, "rb") as file:
            return _tga_footer(file)
    try:
        return _tga_footer(handle)
    finally:
        handle.seek(0)


def _tga_footer(file: IO[bytes]) -> bool:
    """Whether ``file`` ends in the TGA 2.0 footer; without one, whether its header reads as
    a TGA's (a colour map type of 0 or 1, a known image type and pixel depth, a size; no
    colour map fields without a colour map, which no Windows cursor has: its count)."""
    size = file.seek(0, os.SEEK_END)
    if size >= 18 + 26:
        file.seek(size - len(_TGA_FOOTER))
        if file.read(len(_TGA_FOOTER)) == _TGA_FOOTER:
            return True
    file.seek(0)
    header = file.read(18)
    if len(header) < 18:
        return False
    width = int.from_bytes(header[12:14], "little")
    height = int.from_bytes(header[14:16], "little")
    return (header[1] in (0, 1) and header[2] in _TGA_IMAGE_TYPES and header[16] in _TGA_DEPTHS
            and width > 0 and height > 0 and (header[1] == 1) == (header[2] in (1, 9))
            and (header[1] == 1 or header[3:8] == bytes(5)))
