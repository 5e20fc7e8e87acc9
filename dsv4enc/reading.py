"""Reading dsv4enc output back: ``read_embeddings`` streams rows as numpy arrays.

Works on a single Parquet file and on a dataset folder of part files (in input order when the
folder has dsv4enc's ``_manifest.json``, else in sorted file order). Only a few rows are in
memory at a time; values come back exactly as stored (float16 stays float16).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .errors import UsageError

#: Rows per Arrow batch while streaming (a row of the full model is up to ~3 MB in float16).
BATCH_ROWS = 16


def output_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files of an output: the file itself, or a folder's part files in order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UsageError(f"no such file or folder: {path}")
    manifest = path / "_manifest.json"
    if manifest.is_file():
        try:
            parts = json.loads(manifest.read_text()).get("parts", {}).values()
            ordered = sorted(parts, key=lambda p: (p["start"], p["file"]))
            files = [path / p["file"] for p in ordered if (path / p["file"]).is_file()]
            listed = set(files)
            # Rank manifests (--shard-output before the merge) may list more parts.
            others = [f for f in _parquet_under(path) if f not in listed]
            return files + others
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return _parquet_under(path)


def _parquet_under(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        found.extend(Path(root) / f for f in sorted(files)
                     if f.endswith(".parquet") and not f.startswith((".", "_")))
    return found


def embedding_arrays(column) -> list[np.ndarray | None]:
    """One numpy array per row of an ``embedding`` Arrow column: (rows, width) for the list
    layout, (width,) for pooled vectors; None where the value is null. Copies, exact dtype."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        return [a for chunk in column.chunks for a in embedding_arrays(chunk)]
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(column.type):  # pooled: one vector per row
        width = column.type.list_size
        flat = column.values.slice(column.offset * width, len(column) * width)
        matrix = flat.to_numpy(zero_copy_only=False).reshape(len(column), width)
        return [matrix[i].copy() if valid[i] else None for i in range(len(column))]
    width = column.type.value_type.list_size
    offsets = column.offsets.to_numpy()
    lo, hi = int(offsets[0]), int(offsets[-1])
    vectors = column.values.slice(lo, hi - lo)
    flat = vectors.values.slice(vectors.offset * width, (hi - lo) * width)
    matrix = flat.to_numpy(zero_copy_only=False).reshape(hi - lo, width)
    return [matrix[offsets[i] - lo:offsets[i + 1] - lo].copy() if valid[i] else None
            for i in range(len(column))]


def read_embeddings(path: str | os.PathLike, columns: Sequence[str] | None = None, *,
                    errors: str = "skip", batch_rows: int = BATCH_ROWS) -> Iterator[Any]:
    """Stream the rows of a dsv4enc output (a Parquet file or a dataset folder).

    Without ``columns``: yields ``(path, embedding, (grid_h, grid_w))`` per row, where
    ``embedding`` is a numpy array of shape (grid_h*grid_w, width) in the stored dtype (or
    (width,) for a ``--pool mean`` output). With ``columns=[...]``: yields a dict of those
    columns per row (``embedding`` as above, other columns as Python values).

    ``errors="skip"`` (default) passes over rows whose image failed; ``errors="include"``
    yields them too, with ``None`` for the embedding and grid (dicts: the stored nulls).
    Memory stays at ``batch_rows`` rows, whatever the file's size.
    """
    import pyarrow.parquet as pq

    if errors not in ("skip", "include"):
        raise ValueError(f"errors must be 'skip' or 'include', not {errors!r}")
    wanted = list(columns) if columns is not None else None
    need = (wanted or ["path", "grid_h", "grid_w", "embedding"]).copy()
    if errors == "skip" and "error" not in need:
        need.append("error")
    for file in output_files(path):
        handle = pq.ParquetFile(file)
        names = handle.schema_arrow.names
        unknown = [c for c in need if c not in names]
        if unknown:
            raise UsageError(f"{file}: no column {unknown[0]!r} (columns: {', '.join(names)})")
        for batch in handle.iter_batches(batch_size=batch_rows, columns=need):
            data = {name: batch.column(name) for name in need}
            arrays = embedding_arrays(data["embedding"]) if "embedding" in data else None
            failed = (data["error"].is_valid().to_numpy(zero_copy_only=False)
                      if errors == "skip" else None)
            plain = {n: data[n].to_pylist() for n in need if n != "embedding"}
            for i in range(batch.num_rows):
                if failed is not None and failed[i]:
                    continue
                if wanted is not None:
                    yield {n: (arrays[i] if n == "embedding" else plain[n][i]) for n in wanted}
                    continue
                grid = (None if arrays[i] is None
                        else (plain["grid_h"][i], plain["grid_w"][i]))
                yield plain["path"][i], arrays[i], grid


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``dsv4enc`` metadata of an output (its first file's), or {} if there is none."""
    import pyarrow.parquet as pq

    files = output_files(path)
    if not files:
        return {}
    meta = pq.read_schema(files[0]).metadata or {}
    raw = meta.get(b"dsv4enc")
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {}
