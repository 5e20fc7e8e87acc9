"""``read_embeddings``' rate on a real-width output: MB/s of embeddings, wall and per core.

    python benchmarks/read_rate.py --images 48 --repeats 3
    python benchmarks/read_rate.py --images 48 --repeats 3 --trees . /tmp/old-dsv4enc

One file of ``--images`` rows shaped like a 1024x768 photo's aligner output (336 rows x 4096,
float16: 2.75 MB a row; 48 images make 132 MB) is written the way ``dsv4enc encode`` writes
its default binary layout (``rows_to_table``, ``parquet_options``, ``rows_per_group``), read
once to warm the page cache, then read back by ``read_embeddings`` in fresh processes, each
iterating the whole file once (``copy=True``, and ``copy=False`` where the tree has it);
with ``--warm``, once untimed and once timed, so that pyarrow's import and first use (about
36 ms of CPU, a quarter of a 132 MB read) are not counted.
``--trees`` names source trees to import dsv4enc from, one fresh process each per repeat,
interleaved, so that an old and a new reader see the same machine. "per core" divides the
bytes by the process's CPU time (all its threads), "wall" by the elapsed time. One JSON line
per read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from dsv4enc.output.parts import output_schema, parquet_options, rows_per_group, rows_to_table

sys.path.insert(0, str(Path(__file__).parent))
from layouts import synthetic_rows  # noqa: E402 - the same synthetic rows as layouts.py

#: Run in a fresh process: iterate the whole file once, print bytes, wall and CPU seconds.
READ_ONCE = """
import inspect, json, sys, time
from dsv4enc.output.read import read_embeddings
path, copy, warm = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
kwargs = {} if copy else {"copy": False}
if not copy and "copy" not in inspect.signature(read_embeddings).parameters:
    print(json.dumps({"skipped": "no copy= in this tree"})); raise SystemExit
for _ in (read_embeddings(path, **kwargs) if warm else ()):
    pass
wall, cpu, total = time.perf_counter(), time.process_time(), 0
for _, embedding, _ in read_embeddings(path, **kwargs):
    total += embedding.nbytes
print(json.dumps({"bytes": total, "wall_s": time.perf_counter() - wall,
                  "cpu_s": time.process_time() - cpu}))
"""


def write_file(path: Path, images: int, rows: int, width: int) -> None:
    """An output file as ``dsv4enc encode`` writes the binary layout."""
    batch = synthetic_rows(images, rows, width)
    schema = output_schema(width, "float16", {})
    pq.write_table(rows_to_table(batch, schema), path, row_group_size=rows_per_group(schema, batch),
                   **parquet_options(schema))


def read_once(tree: str, path: Path, copy: bool, warm: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    # cwd: ``python -c`` puts the working directory first on sys.path, ahead of the tree
    done = subprocess.run([sys.executable, "-c", READ_ONCE, str(path), "1" if copy else "0",
                           "1" if warm else "0"],
                          env=env, cwd=path.parent, capture_output=True, text=True,
                          check=True)
    result = json.loads(done.stdout)
    if "bytes" in result:
        mb = result["bytes"] / 1e6
        result.update(mb=round(mb, 1), mb_s_wall=round(mb / result["wall_s"]),
                      mb_s_per_core=round(mb / result["cpu_s"]))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--rows", type=int, default=336, help="embedding rows per image")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to read with")
    p.add_argument("--warm", action="store_true", help="time a second read in each process "
                   "(pyarrow's import and first use not counted)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "emb.parquet"
        write_file(path, a.images, a.rows, a.width)
        with open(path, "rb+") as synced:  # on disk, as a run leaves its output, and cached
            os.fsync(synced.fileno())
            while synced.read(1 << 24):
                pass
        for repeat in range(a.repeats):
            for tree in a.trees:
                for copy in (True, False):
                    result = read_once(tree, path, copy, a.warm)
                    print(json.dumps({"repeat": repeat, "tree": tree, "copy": copy,
                                      "warm": a.warm,
                                      "file_mb": round(path.stat().st_size / 1e6, 1),
                                      **result}), flush=True)


if __name__ == "__main__":
    main()
