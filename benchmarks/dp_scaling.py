"""Data-parallel scaling on the CPU: ``torchrun --nproc-per-node N`` against one process.

Writes photo-like JPEGs (smooth gradients, soft blobs and sensor noise; sizes from 640x480 to
1600x1200), then times ``dsv4enc encode`` on a random-init tower (default configs/medium.json)
once as a single process and once under torchrun, every process with one intra-op thread
(OMP_NUM_THREADS=1, so torch.get_num_threads() == 1). Prints a Markdown table: wall time of
the whole launch, the run's own time and img/s (from the summary, without interpreter start),
speedup and scaling efficiency (speedup / N) on both, and the per-rank imbalance the summary
reports.

    python benchmarks/dp_scaling.py                       # 12 images, 2 ranks, default workers
    python benchmarks/dp_scaling.py --workers 0 --workers default --repeats 2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def photo(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """A smooth, photo-like RGB image: a tilted colour gradient, a few soft blobs, noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x /= width
    y /= height
    angle = rng.uniform(0, np.pi)
    t = np.cos(angle) * x + np.sin(angle) * y
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    img = c0 + (c1 - c0) * t[..., None]
    for _ in range(rng.integers(3, 7)):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        img += blob[..., None] * rng.uniform(-120, 120, 3)
    img += rng.normal(0, 6, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def write_images(folder: Path, count: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    sizes = []
    for i in range(count):
        if rng.random() < 0.25:  # portrait
            height = int(rng.integers(640, 1201))
            width = int(height * 0.75)
        else:  # landscape, 4:3 to 16:9
            width = int(rng.integers(640, 1601))
            height = int(np.clip(width * rng.choice([0.75, 0.5625, 0.667]), 480, 1200))
        photo(width, height, rng).save(folder / f"img_{i:03d}.jpg", quality=90)
        sizes.append((width, height))
    return sizes


def parse_summary(stderr: str) -> dict:
    flat = re.sub(r"\s+", " ", stderr)
    out = {}
    m = re.search(r"encoded \S (\d+)", flat)
    out["encoded"] = int(m.group(1)) if m else None
    m = re.search(r"seconds \S ([\d.]+) \(([\d.]+) img/s", flat)
    out["run_s"], out["img_s"] = (float(m.group(1)), float(m.group(2))) if m else (None, None)
    m = re.search(r"rank loads \S ([\d, ]+?) \(imbalance ([\d.]+)\)", flat)
    out["loads"], out["imbalance"] = (m.group(1).strip(), float(m.group(2))) if m else ("-", None)
    return out


def launch(nproc: int, images: Path, out: Path, config: Path, workers: str,
           port: int) -> dict:
    args = ["encode", str(images), "--out", str(out), "--config", str(config), "--random-init",
            "--device", "cpu", "--dtype", "float32", "--overwrite", "-q"]
    if workers != "default":
        args += ["--workers", workers]
    if nproc == 1:
        cmd = [sys.executable, "-m", "dsv4enc", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "dsv4enc", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, **parse_summary(proc.stderr)}


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["run_s"] if r["run_s"] is not None else r["wall_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "medium.json")
    p.add_argument("--workers", action="append", help="decode workers per process: a number "
                   "or 'default' (repeatable; default: default)")
    p.add_argument("--repeats", type=int, default=1, help="launches per setting; best kept")
    p.add_argument("--port", type=int, default=29517)
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dsv4enc-dp-"))
    try:
        images = tmp / "images"
        images.mkdir()
        sizes = write_images(images, a.images)
        print(f"{len(sizes)} JPEGs, {min(w * h for w, h in sizes) / 1e6:.2f}-"
              f"{max(w * h for w, h in sizes) / 1e6:.2f} MP, config {a.config.name}, "
              f"{os.cpu_count()} CPUs", file=sys.stderr)
        rows = []
        for workers in a.workers or ["default"]:
            single = best([launch(1, images, tmp / "one.parquet", a.config, workers, a.port)
                           for _ in range(a.repeats)])
            multi = best([launch(a.nproc, images, tmp / "dp.parquet", a.config, workers,
                                 a.port + 1 + r) for r in range(a.repeats)])
            rows.append((workers, single, multi))

        n = a.nproc
        print(f"| decode workers / process | 1 proc wall s | {n} ranks wall s | wall speedup "
              f"(eff.) | 1 proc run s (img/s) | {n} ranks run s (img/s) | run speedup (eff.) "
              f"| rank loads (patches) | imbalance |")
        print("|---|---|---|---|---|---|---|---|---|")
        for workers, s, m in rows:
            wall_x = s["wall_s"] / m["wall_s"]
            run_x = s["run_s"] / m["run_s"]
            print(f"| {workers} | {s['wall_s']:.1f} | {m['wall_s']:.1f} | {wall_x:.2f}x "
                  f"({wall_x / n:.0%}) | {s['run_s']:.1f} ({s['img_s']:.2f}) | "
                  f"{m['run_s']:.1f} ({m['img_s']:.2f}) | {run_x:.2f}x ({run_x / n:.0%}) | "
                  f"{m['loads']} | {m['imbalance']:.3f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
