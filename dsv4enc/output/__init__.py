"""output: rows, Parquet and manifests (schema, parts and stores, the writer thread,
resume, the joined single file, the remote output, reading back, ``inspect``). Takes plain
values, never the run's options, topology or summary."""

from typing import Literal, get_args

#: The ``embedding`` column's layouts (docs/output-format.md, "Output"). ``binary``: one cell
#: per image holding its (rows, width) array's bytes, little-endian, C order. ``nested``: a
#: list of fixed-size float lists.
Layout = Literal["binary", "nested"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
DEFAULT_LAYOUT: Layout = "binary"
#: The dtypes the ``embedding`` column may hold (``--out-dtype``).
StoredDtype = Literal["float16", "float32"]
STORED_DTYPES: tuple[str, ...] = get_args(StoredDtype)
#: What ``dsv4enc encode`` and ``BatchEncoder`` store when not told.
DEFAULT_STORED_DTYPE: StoredDtype = "float16"
