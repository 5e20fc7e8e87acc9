"""Peak memory against input count: does a run's RSS grow with the number of images?

Writes N small noise PNGs (16-64 px a side; each is upscaled by the transform to a canvas of
up to 729 patches), then encodes the first N of them for each N in ``--counts``, each run in a
fresh process (``run_encode`` in-process there, decoding in worker processes), and reports:

- main: the encoding process's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``);
- workers: the largest peak RSS among its decode workers (``RUSAGE_CHILDREN``, which holds
  the largest of the waited-for children: the workers are joined when the pool closes).

Run once with the default part size (the config decides; for the tiny config a part holds
1024 images, and a part's rows, its Arrow table and the Parquet writer's buffers for it are in
memory until it is written) and once with small parts (``--part-images``), where all that
scales with N is per-image metadata (a few hundred bytes each).

    python benchmarks/memory_rss.py                          # 250 500 1000 2000, tiny config
    python benchmarks/memory_rss.py --counts 250 1000 --part-images 0 64

Every process runs with OMP_NUM_THREADS=1. Only the standard library's ``resource`` is used
(no psutil), so the numbers are Linux's ru_maxrss, in KiB, shown in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def write_images(folder: Path, count: int) -> list[Path]:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        w, h = (int(v) for v in rng.integers(16, 65, 2))
        path = folder / f"img{i:05d}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def child(listing: str, out: str, config: str, part_images: int, workers: int) -> None:
    """One run, in this process; prints peak RSS of this process and of its workers."""
    sys.path.insert(0, str(ROOT))
    from dsv4enc.run.pipeline import EncodeOptions, run_encode

    opts = EncodeOptions(inputs=[], files_from=listing, out=out, config=config,
                         random_init=True, device="cpu", workers=workers,
                         part_images=part_images or None, progress=False, overwrite=True)
    summary = run_encode(opts)
    print(json.dumps({
        "main_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "workers_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        "seconds": summary.seconds, "encoded": summary.encoded, "failed": summary.failed,
    }))


def measure(paths: list[Path], count: int, part_images: int, args, work: Path) -> dict:
    listing = work / f"list{count}.txt"
    listing.write_text("".join(f"{p}\n" for p in paths[:count]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(listing), str(work / "out.parquet"),
         args.config, str(part_images), str(args.workers)],
        capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run of {count} images failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall"] = time.perf_counter() - began
    assert result["encoded"] == count, result
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[250, 500, 1000, 2000])
    parser.add_argument("--part-images", type=int, nargs="+", default=[0, 64],
                        help="0: the default part size")
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.json"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--child", nargs=5, metavar=("LIST", "OUT", "CONFIG", "PART", "WORKERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        listing, out, config, part, workers = args.child
        child(listing, out, config, int(part), int(workers))
        return
    with tempfile.TemporaryDirectory(prefix="dsv4enc-rss-") as tmp:
        work = Path(tmp)
        paths = write_images(work / "images", max(args.counts))
        print(f"config {Path(args.config).name}, {args.workers} decode worker(s), "
              "OMP_NUM_THREADS=1\n")
        print("| images | part images | main peak RSS MiB | decode worker peak RSS MiB "
              "| run s | img/s |")
        print("|---|---|---|---|---|---|")
        for part in args.part_images:
            for count in args.counts:
                r = measure(paths, count, part, args, work)
                print(f"| {count} | {part or 'default'} | {r['main_kib'] / 1024:.0f} | "
                      f"{r['workers_kib'] / 1024:.0f} | {r['seconds']:.1f} | "
                      f"{count / r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
