"""Parquet tables from rows: built from buffers (no per-value Python objects), equal to what
pyarrow makes from plain values, in both embedding layouts, without importing pandas."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from dsv4enc.output.parts import Row, output_schema, rows_to_table


def sample_rows(width: int, pooled: bool) -> list[Row]:
    rng = np.random.default_rng(0)
    shape = (width,) if pooled else (6, width)
    return [Row("a.png", 10, 20, 2, 3, 2, 3, rng.standard_normal(shape).astype(np.float16)),
            Row("caf\xe9/b.png", error="OSError: truncated"),
            Row("c.png", 1, 1, 1, 1, 1, 1, rng.standard_normal(shape).astype(np.float16))]


def python_value(embedding: np.ndarray | None, layout: str):
    """What a row's embedding is as a plain Python value in ``layout``."""
    if embedding is None:
        return None
    return embedding.astype("<f2").tobytes() if layout == "binary" else embedding.tolist()


@pytest.mark.parametrize("layout", ["binary", "nested"])
@pytest.mark.parametrize("pooled", [False, True])
def test_tables_from_buffers_equal_tables_from_python_values(pooled, layout):
    schema = output_schema(4, "float16", {"x": 1}, pooled=pooled, layout=layout)
    rows = sample_rows(4, pooled)
    table = rows_to_table(rows, schema)
    table.validate(full=True)
    expected = pa.Table.from_pylist([
        {**vars(r), "embedding": python_value(r.embedding, layout)} for r in rows],
        schema=schema)
    assert table.equals(expected)
    assert rows_to_table([], schema).num_rows == 0


def test_building_and_writing_a_table_does_not_import_pandas(tmp_path):
    code = (
        "import sys, numpy as np, pyarrow.parquet as pq\n"
        "from dsv4enc.output.parts import Row, output_schema, rows_to_table, parquet_options\n"
        "schema = output_schema(4, 'float16', {})\n"
        "rows = [Row('a', 1, 1, 1, 1, 1, 1, np.ones((1, 4), np.float16)), Row('b', error='x')]\n"
        f"pq.write_table(rows_to_table(rows, schema), {str(tmp_path / 'o.parquet')!r},\n"
        "               **parquet_options(schema))\n"
        "assert 'pandas' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
