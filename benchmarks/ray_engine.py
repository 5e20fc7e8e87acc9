"""`dsv4enc encode --engine ray` against the local engine on the same images, interleaved.

    python benchmarks/ray_engine.py [--config configs/medium.json] [--images 24] [--pairs 2]

Writes N synthetic 1024x768 photos (`dsv4enc bench`'s source), then runs, `--pairs` times in
turn, `dsv4enc encode` (local engine) and `dsv4enc encode --engine ray` (a local Ray started
by the command, 2 CPUs, one encoder actor) as fresh processes: random weights of the config,
CPU, float32 compute, float16 rows, one output file each. Reads each run's encoding-loop rate
and wall time from --summary-json, prints one line per run and the ratios (ray / local), and
checks that every run wrote the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from dsv4enc.bench.throughput import synthetic_images


def encode(images: Path, out: Path, config: str, engine: str) -> dict:
    summary = out.with_suffix(".json")
    args = [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out", str(out),
            "--config", config, "--random-init", "--device", "cpu", "--dtype", "float32",
            "-q", "--summary-json", str(summary)]
    if engine == "ray":
        args += ["--engine", "ray", "--ray-object-store-mb", "200"]
    began = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - began
    done = json.loads(summary.read_text())
    n = done["images"]["encoded"] + done["images"]["failed"]
    return {"engine": engine, "loop": done["rates"]["images_per_s"], "wall": n / wall,
            "wall_s": wall, "images": n}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/medium.json")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    config = str(Path(args.config).resolve())
    root = Path(tempfile.mkdtemp(prefix="dsv4enc-rayengine-"))
    images = root / "images"
    synthetic_images(images, f"1024x768:{args.images}")
    runs, reference = [], None
    for pair in range(args.pairs):
        for engine in ("local", "ray"):
            out = root / f"{engine}-{pair}.parquet"
            run = encode(images, out, config, engine)
            table = pq.read_table(out)
            reference = table if reference is None else reference
            run["same_bytes"] = table.equals(reference)
            runs.append(run)
            print(f"{engine:5s} pair {pair}: loop {run['loop']:.3f} img/s, wall "
                  f"{run['wall']:.3f} img/s ({run['wall_s']:.1f}s), same bytes "
                  f"{run['same_bytes']}", flush=True)
    for key in ("loop", "wall"):
        ratios = [ray[key] / local[key] for local, ray in zip(runs[0::2], runs[1::2])]
        print(f"ray/local {key}: median {statistics.median(ratios):.2f} "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
