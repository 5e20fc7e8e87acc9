"""The columns every output row has, and the text a key takes in the ``path`` column: what
``images/`` (a kept table column never takes an output column's name; a key is the text its
row will hold) and ``output/`` (the schema, the rows, the stamps) both name."""

from __future__ import annotations

#: The int32 columns of every output, in order.
INT_COLUMNS = ("width", "height", "vit_h", "vit_w", "grid_h", "grid_w")
#: The columns every output has, in order (docs/output-format.md), before the kept ones.
OUTPUT_COLUMNS = ("path", *INT_COLUMNS, "embedding", "error")
#: The key of the schema metadata every output's footer carries (its settings, as JSON): an
#: output is known by it, as a table given as an input is never read for images.
OUTPUT_METADATA_KEY = b"dsv4enc"


def utf8_text(name: str) -> str:
    """``name`` as valid UTF-8 text for the ``path`` column: bytes of a file name that are not
    UTF-8 (held by Python as surrogates) become backslash escapes, e.g. ``caf\\xe9.png``."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        try:
            return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            return name.encode("utf-8", "backslashreplace").decode("utf-8")
