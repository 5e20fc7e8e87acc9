"""The torch datasets' rate (``dsv4enc.dataset``) against ``read_embeddings`` on one real-width
file: rows/s and MB/s of embeddings, wall and per core.

    python benchmarks/dataset_rate.py --images 48 --repeats 3

The file is ``read_rate.py``'s (``--images`` rows shaped like a 1024x768 photo's aligner
output: 336 rows x 4096, float16, 2.75 MB a row, the default binary layout), read once to warm
the page cache. Each reader then runs in a fresh process and takes every row once:
``read_embeddings`` (copies, as a loop that keeps its rows gets them), the iterable dataset
in the process (``workers 0``, shuffled), the same through a DataLoader with ``--workers``
worker processes and ``collate_embeddings`` (batches of 8), and the map-style dataset by
index in a shuffled order; each for ``--epochs`` epochs in one process (the DataLoader's
workers persistent), timed one by one. "per core" divides the bytes by the CPU time of the
process and its children (the workers' once they have ended), "wall" by the elapsed time.
One JSON line per epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from read_rate import write_file  # noqa: E402 - the same file as read_rate.py

#: Run in a fresh process: read every row once with one reader; print rows, bytes, times.
READ_ONCE = """
import json, os, sys, time
import numpy as np
path, reader, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
import torch
from torch.utils.data import DataLoader
from dsv4enc.dataset import EmbeddingDataset, EmbeddingIterableDataset, collate_embeddings
from dsv4enc.output.read import read_embeddings
def cpu():
    times = os.times()
    return times[0] + times[1] + times[2] + times[3]
def epoch(state):
    rows = total = 0
    if reader == "read_embeddings":
        for _, embedding, _ in read_embeddings(path):
            rows, total = rows + 1, total + embedding.nbytes
    elif reader == "iterable":
        state["data"].set_epoch(state["epoch"])
        for batch in state["loader"]:
            rows += len(batch["path"])
            total += int(batch["lengths"].sum()) * batch["embedding"].shape[-1] * 2
    else:
        data = state["data"]
        for i in np.random.default_rng(state["epoch"]).permutation(len(data)).tolist():
            item = data[i]
            rows, total = rows + 1, total + item["embedding"].numel() * 2
    return rows, total
state = {"epoch": 0}
if reader == "iterable":
    state["data"] = EmbeddingIterableDataset(path, shuffle=True)
    state["loader"] = DataLoader(state["data"], batch_size=8, num_workers=workers,
                                 persistent_workers=workers > 0, collate_fn=collate_embeddings)
elif reader == "map":
    state["data"] = EmbeddingDataset(path)
for number in range(EPOCHS):
    state["epoch"] = number
    wall, start = time.perf_counter(), cpu()
    rows, total = epoch(state)
    print(json.dumps({"epoch": number, "rows": rows, "bytes": total,
                      "wall_s": time.perf_counter() - wall, "cpu_s": cpu() - start}))
"""

READERS = (("read_embeddings", 0), ("iterable", 0), ("iterable", None), ("map", 0))


def read_once(path: Path, reader: str, workers: int, epochs: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = f"EPOCHS = {epochs}\n{READ_ONCE}"
    done = subprocess.run([sys.executable, "-c", code, str(path), reader, str(workers)],
                          env=env, cwd=path.parent, capture_output=True, text=True, check=True)
    results = [json.loads(line) for line in done.stdout.splitlines()]
    for result in results:
        mb = result["bytes"] / 1e6
        result.update(mb=round(mb, 1), mb_s_wall=round(mb / result["wall_s"]),
                      mb_s_per_core=round(mb / max(result["cpu_s"], 1e-3)),
                      rows_s_wall=round(result["rows"] / result["wall_s"], 1))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--rows", type=int, default=336, help="embedding rows per image")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="epochs per process (the first "
                   "starts the workers and warms the allocator)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "emb.parquet"
        write_file(path, a.images, a.rows, a.width)
        with open(path, "rb") as cached:  # in the page cache, as a just-written output is
            while cached.read(1 << 24):
                pass
        for repeat in range(a.repeats):
            for reader, workers in READERS:
                workers = a.workers if workers is None else workers
                for result in read_once(path, reader, workers, a.epochs):
                    print(json.dumps({"repeat": repeat, "reader": reader, "workers": workers,
                                      **result}), flush=True)


if __name__ == "__main__":
    main()
