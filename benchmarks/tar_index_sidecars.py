"""What ``--keep-member`` adds to indexing a WebDataset shard: the index's time, and the
memory its items hold, with and without the sidecars' text.

    python benchmarks/tar_index_sidecars.py --samples 20000 --repeats 5

One local shard of ``--samples`` samples, each an image member (random bytes, 20 KB: the
index reads no image) with a ``.txt`` caption (about 60 bytes) and a ``.json`` (about 40
bytes), in the page cache; ``images/sources.expand_tar`` indexes it ``--repeats`` times each
way, interleaved. One JSON line per way: the best and median seconds, and the bytes the
items hold (``tracemalloc``: what the index allocated and kept).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path

from dsv4enc.images.sources import expand_tar


def write_shard(path: Path, samples: int) -> None:
    image = os.urandom(20_000)
    with tarfile.open(path, "w") as archive:
        for i in range(samples):
            for ext, data in (("jpg", image),
                              ("txt", f"a photo of sample {i} on a plain background, daylight".encode()),
                              ("json", json.dumps({"id": i, "source": "bench"}).encode())):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def held_bytes(path: str, members: tuple[str, ...]) -> int:
    tracemalloc.start()
    items, _ = expand_tar(path, keep_members=members)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del items
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        shard = Path(folder) / "train-00000.tar"
        write_shard(shard, args.samples)
        shard.read_bytes()  # into the page cache
        ways = {"images only": (), "--keep-member txt json": ("txt", "json")}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, members in ways.items():
                began = time.perf_counter()
                items, _ = expand_tar(str(shard), keep_members=members)
                times[name].append(time.perf_counter() - began)
                assert len(items) == args.samples
        for name, members in ways.items():
            print(json.dumps({"way": name, "samples": args.samples,
                              "shard_mb": round(shard.stat().st_size / 1e6, 1),
                              "best_s": round(min(times[name]), 3),
                              "median_s": round(statistics.median(times[name]), 3),
                              "items_bytes": held_bytes(str(shard), members)}))


if __name__ == "__main__":
    main()
