"""Memory a single output file's joiner holds per part until it writes the footer.

A part file is written as a run writes one (the output's schema at the full config's width,
``parquet_options``, one row group of ``--rows`` images), then ``ParquetJoiner.append``-ed
``--parts`` times; Python's traced memory is read after the appends (what the joiner holds
per part) and at the peak of ``close`` (the footer's assembly). Prints one line, with the
joined file's SHA-256 prefix, so that two trees can be checked to write the same bytes:

    PYTHONPATH=TREE python benchmarks/join_memory.py --parts 2000
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dsv4enc.output.parquet_join import ParquetJoiner
from dsv4enc.output.parts import Row, output_schema, parquet_options, rows_to_table


def part_file(folder: Path, rows: int, width: int) -> Path:
    """One part of ``rows`` images of 6 tokens each, as a run writes it."""
    schema = output_schema(width, "float16", {"dsv4enc": "{}"}, pooled=False, layout="binary")
    rng = np.random.default_rng(0)
    table = rows_to_table([Row(f"img{i:06d}.jpg", 1, 2, 3, 4, 2, 3,
                               rng.standard_normal((6, width)).astype(np.float16))
                           for i in range(rows)], schema)
    path = folder / "part.parquet"
    pq.write_table(table, path, row_group_size=rows, **parquet_options(schema))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=43)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        part = part_file(folder, args.rows, args.width)
        joiner = ParquetJoiner(folder / "joined.parquet")
        tracemalloc.start()
        for _ in range(args.parts):
            joiner.append(part)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        joiner.close()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        digest = hashlib.sha256((folder / "joined.parquet").read_bytes()).hexdigest()[:16]
    print(f"{args.parts} parts of {args.rows} rows: {held / args.parts:,.0f} bytes held a part "
          f"after the appends, {peak / 1e6:.1f} MB at the footer's peak; sha256 {digest}")


if __name__ == "__main__":
    main()
