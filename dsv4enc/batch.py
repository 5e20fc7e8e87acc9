"""One batch function for pipelines: ``BatchEncoder``, built once (the weights are loaded
once), then called once per batch (Ray Data's ``map_batches``, ``datasets.map(batched=True)``,
a Daft or Spark UDF, a plain loop)::

    embed = BatchEncoder("/path/to/checkpoint", image_column="image", key_column="id")
    out = embed(batch)        # pyarrow Table / RecordBatch, pandas DataFrame, dict of arrays

``out``: ``dsv4enc encode``'s rows for the batch (docs/output-format.md), batch-invariant, in
input order and of the kind given, then the batch's other columns."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .columns import INT_COLUMNS, OUTPUT_COLUMNS
from .engine.defaults import DEFAULT_FEATURES, DEFAULT_POOL, Features, Pool
from .errors import SettingsError, check_choice, check_flag
from .images.formats import DEFAULT_MAX_PIXELS
from .images.prepare import Prepared, image_source, prepare
from .images.sources import unchecked_values
from .output import (DEFAULT_LAYOUT, DEFAULT_STORED_DTYPE, LAYOUTS, STORED_DTYPES, Layout,
                     StoredDtype)
from .output.parts import Row, output_schema, rows_to_table, run_settings

if TYPE_CHECKING:
    from .api import Encoder

__all__ = ["BatchEncoder", "datasets_features", "OUTPUT_COLUMNS"]

#: The recipe's entries that are BatchEncoder's own, not ``Encoder`` options.
_NOT_ENCODER_OPTIONS = frozenset({"weights", "config", "seed", "max_pixels", "image_column",
                                  "key_column", "layout", "keep_columns"})

#: The process that imported this module, or whose torch threads ``_fork_safe_threads`` set:
#: another pid is a forked child (``datasets.map`` with ``num_proc``, a fork pool).
_threads_pid = os.getpid()


def _fork_safe_threads() -> None:
    """One torch intra-op thread in a forked child: a child forked from a process whose OpenMP
    threads ran waits for good in its first parallel region (the fork copied no threads),
    while one thread runs inline."""
    global _threads_pid
    if os.getpid() != _threads_pid:
        _threads_pid = os.getpid()
        import torch

        torch.set_num_threads(1)


class BatchEncoder:
    """A batch function: a table of images in, ``dsv4enc encode``'s rows out (docs/api.md:
    its columns in and out, and its options, those of ``dsv4enc encode`` and ``Encoder``).
    ``weights``: a checkpoint folder or Hub id (default ``DSV4ENC_WEIGHTS``), or ``config``
    with ``seed`` for random weights. Only what is no image's fault raises: a missing column,
    one example instead of a batch, or an embedding not finite in ``out_dtype``
    (``api.EncodeError``).

    Pickling sends the recipe (weights, config and options), not the tensors: an unpickled
    copy loads its own weights, and ``datasets``' cache fingerprint is cheap. In a forked
    process it builds its own engine and runs torch on one thread. Not thread-safe."""

    def __init__(self, weights: str | os.PathLike | None = None, *,
                 config: str | os.PathLike | Mapping[str, Any] | None = None, seed: int = 0,
                 image_column: str = "image", key_column: str | None = None,
                 device: str = "auto", dtype: str = "auto", features: Features = DEFAULT_FEATURES,
                 pool: Pool = DEFAULT_POOL, out_dtype: StoredDtype = DEFAULT_STORED_DTYPE,
                 layout: Layout = DEFAULT_LAYOUT,
                 max_pixels: int | None = None, keep_columns: bool = True,
                 **options: Any) -> None:
        check_choice("out_dtype", out_dtype, STORED_DTYPES)
        check_choice("layout", layout, LAYOUTS)
        check_flag("keep_columns", keep_columns)  # "no" is truthy
        if image_column is None:  # refused here, not at each batch by pandas or pyarrow
            raise SettingsError("image_column must name the batch's image column, not None")
        if weights is not None and config is not None:  # the command refuses it too
            raise SettingsError("give weights or config= (random weights), not both: a "
                                "checkpoint has its own config.json")
        if weights is None and config is None:
            weights = os.environ.get("DSV4ENC_WEIGHTS")
            if not weights:
                raise ValueError("give weights (a checkpoint folder or Hub id) or config= "
                                 "(random weights); DSV4ENC_WEIGHTS is not set")
        self._recipe = dict(weights=weights, config=config, seed=seed, image_column=image_column,
                            key_column=key_column, device=device, dtype=dtype, features=features,
                            pool=pool, out_dtype=out_dtype, layout=layout, max_pixels=max_pixels,
                            keep_columns=keep_columns, **options)
        self.image_column, self.key_column = image_column, key_column
        self.keep_columns, self.layout = keep_columns, layout
        self.max_pixels = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
        self.pid = os.getpid()  # the process the engine was built in
        self.encoder = self._build()
        self.schema = output_schema(self.encoder.width(), out_dtype, self.settings(),
                                    pooled=pool == "mean", layout=layout)

    def _build(self) -> "Encoder":
        """The encoder (weights and engine) of the recipe, built in this process."""
        from .api import Encoder

        _fork_safe_threads()
        recipe = self._recipe
        options = {name: value for name, value in recipe.items()
                   if name not in _NOT_ENCODER_OPTIONS}
        options["max_pixels"] = self.max_pixels
        if recipe["weights"] is not None:
            return Encoder.from_pretrained(recipe["weights"], **options)
        return Encoder.from_config(recipe["config"], seed=recipe["seed"], **options)

    def _own_encoder(self) -> "Encoder":
        """The encoder, rebuilt first when this object crossed a fork (a forked process never
        runs the parent's threads' or device's state)."""
        if os.getpid() != self.pid:
            self.pid = os.getpid()
            self.encoder = self._build()
        return self.encoder

    # -- what it is -------------------------------------------------------------------
    def __reduce__(self):
        return functools.partial(BatchEncoder, **self._recipe), ()

    def __repr__(self) -> str:
        return (f"BatchEncoder({self.encoder!r}, image_column={self.image_column!r}, "
                f"key_column={self.key_column!r}, layout={self.layout!r})")

    @property
    def device(self):
        return self.encoder.device

    def settings(self) -> dict[str, Any]:
        """What the rows were computed with: the ``dsv4enc`` metadata of ``dsv4enc encode``."""
        enc = self.encoder
        return run_settings(enc.config, enc.fingerprint, enc.dtype, enc.device.type,
                            bool(enc.deterministic), out_dtype=enc.out_dtype,
                            features=enc.features, pool=enc.pool, layout=self.layout,
                            fused=enc.model.fused)

    def features(self, kept: Any = None):
        """``datasets_features`` of the output, after the ``kept`` features."""
        return datasets_features(self.schema, kept)

    # -- the call ----------------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        """Encode one batch; returns its rows as the same kind of batch (see the class)."""
        kind, table, kept = self.encoded(batch)
        if kind in ("table", "record_batch"):
            for name in kept:
                table = table.append_column(name, batch.column(name))
            return _as_kind(table, kind)
        out = _as_kind(table, kind)
        for name in kept:
            out[name] = batch[name].reset_index(drop=True) if kind == "pandas" else batch[name]
        return out

    def table(self, batch: Any) -> pa.Table:
        """The batch's rows as a pyarrow Table, whatever kind of batch came in: the output
        columns (``self.schema``), then the kept columns, each as pyarrow reads it."""
        kind, table, kept = self.encoded(batch)
        if kept and kind == "pandas":
            batch = pa.Table.from_pandas(batch[kept], preserve_index=False)
        for name in kept:
            column = batch[name]
            if not isinstance(column, (pa.Array, pa.ChunkedArray)):  # a list or numpy array
                column = pa.array(column if getattr(column, "ndim", 2) == 1 else list(column))
            table = table.append_column(name, column)
        return table

    def encoded(self, batch: Any) -> tuple[str, pa.Table, list[str]]:
        """The batch's kind, its output columns, and the names of its kept columns (for a
        caller that joins those columns its own way: ``ray.RayEncoder``)."""
        kind, images, keys = self.columns(batch)
        return kind, self.encode_table(images, keys), self.kept_columns(batch)

    def kept_columns(self, batch: Any) -> list[str]:
        """The batch's columns that pass through to its rows (``keep_columns``): all but the
        image column and those named as an output column (the output's replaces them)."""
        if not self.keep_columns:
            return []
        return [name for name in _batch_columns(batch)[1]
                if name != self.image_column and name not in OUTPUT_COLUMNS]

    def encode_table(self, images: list[Any], keys: list[Any] | None = None) -> pa.Table:
        """Rows (a pyarrow Table of ``self.schema``) for a list of images and their keys."""
        return rows_to_table(self.rows(images, keys), self.schema).combine_chunks()

    def rows(self, images: list[Any], keys: list[Any] | None = None) -> list:
        """``output.parts.Row`` objects, one per image in order (error rows included)."""
        from .engine.packing import output_grid

        enc = self._own_encoder()
        keyed = [(image, None if keys is None else keys[i]) for i, image in enumerate(images)]
        rows = []
        for item, out in enc.stream(enc.prepared(keyed, self._prepare)):
            row = Row(path=item.key, width=item.width, height=item.height, error=item.error)
            if item.error is None:
                row.vit_h, row.vit_w = item.n_h, item.n_w
                row.grid_h, row.grid_w = output_grid(item.n_h, item.n_w,
                                                     enc.config.downsample_ratio, enc.features)
                row.embedding = out.numpy()
            rows.append(row)
        return rows

    # -- internals ---------------------------------------------------------------------
    def columns(self, batch: Any) -> tuple[str, list[Any], list[Any] | None]:
        """(kind, image values, key values) of a batch."""
        kind, names, column = _batch_columns(batch)
        for name in (self.image_column, self.key_column):
            if name is not None and name not in names:
                raise KeyError(f"the batch has no column {name!r} (columns: "
                               f"{', '.join(map(str, names))}); set image_column= / key_column=")
        keys = column(self.key_column) if self.key_column is not None else None
        return kind, column(self.image_column), keys

    def _prepare(self, index: int, entry: tuple[Any, Any]) -> Prepared:
        """One input (an image and its key) prepared, keyed by its ``path`` text (runs on the
        encoder's threads)."""
        image, key = (None if _missing(value) else value for value in entry)
        source, name = image_source(image)
        if isinstance(key, bytes):  # bytes not UTF-8 as ``\xNN``, as the command writes them
            key = key.decode("utf-8", "backslashreplace")
        item = Prepared((name or f"#{index}") if key is None or key == "" else str(key), index)
        if source is None or isinstance(source, str) and not source:  # "": names no file
            held = f"null {self.image_column!r}" if image is None else (
                f"{self.image_column!r} holds neither bytes nor a path")
            return item.failed(f"ValueError: row has no image ({held})")
        return prepare(source, self.encoder.config, self.max_pixels, item)


def datasets_features(schema: "pa.Schema | BatchEncoder", features: Any = None):
    """The Hugging Face ``datasets.Features`` of ``BatchEncoder``'s rows (give ``features=``
    to ``datasets.Dataset.map``: a batch whose ``error`` or ``embedding`` cells are all null
    then keeps the column's type). ``schema``: a ``BatchEncoder`` or its schema.

    ``features``: those of the columns the mapped dataset keeps beside the rows, which come
    first, as ``map`` orders them; an output column replaces a kept one of its name."""
    import datasets

    if isinstance(schema, BatchEncoder):
        schema = schema.schema
    out = datasets.Features.from_arrow_schema(schema)
    if not features:
        return out
    return datasets.Features({**{name: feature for name, feature in features.items()
                                 if name not in out}, **out})


def _batch_columns(batch: Any) -> tuple[str, list[str], Callable[[str], list[Any]]]:
    """A batch's kind, its column names, and a function giving one column's values."""
    if isinstance(batch, (pa.Table, pa.RecordBatch)):
        kind = "table" if isinstance(batch, pa.Table) else "record_batch"
        return kind, batch.schema.names, lambda name: _arrow_values(batch.column(name))
    if _is_pandas(batch):
        return "pandas", list(batch.columns), lambda name: _pandas_values(batch[name])
    if isinstance(batch, Mapping):
        kind = "numpy" if any(isinstance(v, np.ndarray) for v in batch.values()) else "lists"
        return kind, list(batch.keys()), lambda name: _listed(name, batch[name])
    raise TypeError(f"a batch is a pyarrow Table or RecordBatch, a pandas DataFrame "
                    f"or a dict of columns, not {type(batch).__name__}")


def _arrow_values(column: "pa.Array | pa.ChunkedArray") -> list[Any]:
    """An Arrow column's values, read as the command reads a table's: a string cell that is
    not UTF-8 (Arrow's and Parquet's writers do not check) as its bytes
    (``sources.unchecked_values``), which a string column gives as ``os.fsdecode`` makes them
    text: a path names the file of those bytes, never read as an image's bytes, and a key is
    written ``\\xNN`` in ``path`` (``columns.utf8_text``)."""
    values = unchecked_values(column)
    text = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if pa.types.is_string(text) or pa.types.is_large_string(text) or (
            hasattr(pa.types, "is_string_view") and pa.types.is_string_view(text)):
        return [os.fsdecode(value) if isinstance(value, bytes) else value for value in values]
    return values


def _listed(name: str, values: Any) -> list[Any]:
    """A dict batch's column as a list; one value instead (datasets' map without
    ``batched=True`` hands over one example) is refused, not read as a batch of its
    characters or bytes."""
    if (isinstance(values, (str, bytes, bytearray, memoryview, Mapping))
            or not isinstance(values, Iterable) or getattr(values, "ndim", 1) == 0):
        raise TypeError(f"the batch's column {name!r} holds one {type(values).__name__}, not a "
                        f"column of values: a dict batch holds a list or array per column "
                        f"(with datasets: map(..., batched=True))")
    return list(values)


def _missing(value: Any) -> bool:
    """Whether ``value`` is NaN or pandas' NA or NaT: how a numpy or list batch (Ray's, a
    DataFrame's made numpy) holds a null key or image."""
    if isinstance(value, (float, np.floating)):
        return value != value
    if not type(value).__module__.startswith("pandas"):
        return False  # pandas is imported only for its own values
    import pandas as pd

    return pd.api.types.is_scalar(value) and bool(pd.isna(value))


def _is_pandas(batch: Any) -> bool:
    if not type(batch).__module__.startswith("pandas"):
        return False  # pandas is imported only for its own batches
    import pandas as pd

    return isinstance(batch, pd.DataFrame)


def _pandas_values(column: Any) -> list[Any]:
    """A pandas column's values, a missing one (NaN, pandas.NA: how pandas stores a null
    string, key or image) as None, as pyarrow gives it; an Arrow-backed column's as its Arrow
    array's (a string cell not UTF-8 too, which pandas cannot make an object of)."""
    import pandas as pd

    if isinstance(column.dtype, pd.ArrowDtype):
        return _arrow_values(pa.array(column))
    return column.astype(object).where(column.notna(), None).tolist()


def _as_kind(table: pa.Table, kind: str) -> Any:
    """``table`` as the kind of batch that came in."""
    if kind == "table":
        return table
    if kind == "record_batch":
        batches = table.to_batches()
        return batches[0] if len(batches) == 1 else pa.RecordBatch.from_pylist(
            table.to_pylist(), schema=table.schema)
    if kind == "pandas":
        import pandas as pd

        # Arrow-backed columns keep their types (int32 with nulls, string, large_binary):
        # the DataFrame turns back into the same Arrow table.
        return table.to_pandas(types_mapper=pd.ArrowDtype)
    columns = table.to_pydict()
    if kind == "lists":
        return columns
    out: dict[str, np.ndarray] = {}
    for name, values in columns.items():
        if name in INT_COLUMNS and None not in values:
            out[name] = np.asarray(values, dtype=np.int32)
        else:
            array = np.empty(len(values), dtype=object)
            array[:] = values
            out[name] = array
    return out
