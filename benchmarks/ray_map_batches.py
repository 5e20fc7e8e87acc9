"""RayEncoder in Ray Data's map_batches against `dsv4enc encode` on the same images.

    python benchmarks/ray_map_batches.py [--config configs/medium.json] [--images 64]

Writes N synthetic 1024x768 JPEGs, runs `dsv4enc encode` (random weights of the config, CPU,
float32) as a fresh process and reads its encoding-loop rate from --summary-json, then runs
one RayEncoder actor (2 CPUs) over the same files on a local Ray (2 CPUs) and times the
dataset's execution (actor start and weight loading included) and write_parquet. Prints both
rates and checks that the rows are the same bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/medium.json")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    config = str(Path(args.config).resolve())
    root = Path(tempfile.mkdtemp(prefix="dsv4enc-raybench-"))
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(args.images):
        pixels = rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{i:05d}.jpg", quality=90)

    local_out = root / "local.parquet"
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsv4enc", "encode", str(images), "--out",
                    str(local_out), "--config", config, "--random-init", "--device", "cpu",
                    "--dtype", "float32", "-q", "--summary-json", str(root / "summary.json")],
                   check=True, stdout=subprocess.DEVNULL)
    local_wall = time.perf_counter() - began
    summary = json.loads((root / "summary.json").read_text())
    print(f"local: {summary.get('rates', summary)} wall {local_wall:.1f}s")

    import ray

    from dsv4enc.ray import encode_dataset

    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20,
             include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    files = sorted(images.glob("*.jpg"))
    ds = ray.data.from_items([{"image": str(p), "key": p.name} for p in files])
    began = time.perf_counter()
    rows = encode_dataset(ds, config=config, dtype="float32", key_column="key",
                          keep_columns=False,  # the command's columns only: compared below
                          batch_size=args.batch_size, num_cpus=2).materialize()
    ray_s = time.perf_counter() - began
    rows.write_parquet(str(root / "ray"))
    ray_wall = time.perf_counter() - began
    ray.shutdown()
    print(f"ray: {len(files) / ray_s:.2f} img/s ({ray_s:.1f}s, actor start included), "
          f"{len(files) / ray_wall:.2f} img/s with write_parquet ({ray_wall:.1f}s)")
    local = {r["path"]: r for r in pq.read_table(local_out).to_pylist()}
    got = {r["path"]: r for f in sorted((root / "ray").glob("*.parquet"))
           for r in pq.read_table(f).to_pylist()}
    print("rows equal:", got == local, len(got), len(local))


if __name__ == "__main__":
    main()
