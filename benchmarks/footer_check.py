"""What checking an output's footers costs (``output/read.check_column_chunks``): per part,
against ``pq.read_metadata`` alone (the scan ``--resume`` and ``--update`` make over a folder's
parts), and per row group of one file (a reader's first open).

    python benchmarks/footer_check.py [--parts 1000] [--groups 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dsv4enc.output.parts import output_schema, parquet_options
from dsv4enc.output.read import check_column_chunks


def table(rows: int) -> tuple[pa.Table, pa.Schema]:
    """``rows`` rows of the output schema (width 2048, float16), 4 KiB embeddings."""
    schema = output_schema(2048, "float16", {}, pooled=False, layout="binary")
    columns = {}
    for field in schema:
        if field.name == "path":
            columns[field.name] = pa.array([f"img{i}.jpg" for i in range(rows)])
        elif field.name == "embedding":
            columns[field.name] = pa.array([b"x" * 4096] * rows, field.type)
        elif field.name == "error":
            columns[field.name] = pa.array([None] * rows, field.type)
        else:
            columns[field.name] = pa.array(np.ones(rows, dtype=np.int32), field.type)
    return pa.table(columns, schema=schema), schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    part, schema = table(50)
    for i in range(args.parts):
        pq.write_table(part, folder / f"part-{i:06d}.parquet", **parquet_options(schema))
    single, _ = table(2 * args.groups)
    pq.write_table(single, folder / "single.parquet", row_group_size=2,
                   **parquet_options(schema))
    paths = sorted(folder.glob("part-*.parquet"))
    for _ in range(args.rounds):
        start = time.perf_counter()
        for path in paths:
            pq.read_metadata(path)
        alone = (time.perf_counter() - start) / len(paths)
        start = time.perf_counter()
        for path in paths:
            check_column_chunks(pq.read_metadata(path))
        checked = (time.perf_counter() - start) / len(paths)
        footer = pq.read_metadata(folder / "single.parquet")
        start = time.perf_counter()
        check_column_chunks(footer)
        group = (time.perf_counter() - start) / footer.num_row_groups
        print(f"read_metadata {alone * 1e3:.3f} ms a part, with the check {checked * 1e3:.3f}; "
              f"the check {group * 1e3:.3f} ms a row group ({footer.num_row_groups} groups)")


if __name__ == "__main__":
    main()
