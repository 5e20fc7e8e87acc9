"""Torchrun on a mixed-size folder, one source tree against another: ranks' loads, imbalance,
and the rows.

Writes a folder of PNGs and JPEGs of mixed sizes (fixed seed), then for each ``--tree`` runs
``dsv4enc encode`` with that tree first on PYTHONPATH: once under ``torchrun
--nproc-per-node N`` (gloo, CPU) and once as one process, with the golden checkpoint,
float32, deterministic, ``OMP_NUM_THREADS=1``. Reads the summary's rank loads and imbalance,
and checks that every run's ``path``, ``embedding`` and ``error`` columns equal the first
run's, value for value. Trees take turns, round by round.

    python benchmarks/torchrun_trees.py --tree old=/work/wt/old --tree new=/work/main
    python benchmarks/torchrun_trees.py --tree old=/work/wt/old --tree new=/work/main \
        --part-images 16
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

GOLDEN = Path(os.environ.get("DSV4ENC_GOLDEN", "/work/shared/golden"))


def write_images(folder: Path, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """``count`` noisy gradients from 28x28 to 600x400, a third of them JPEG."""
    rng = np.random.default_rng(seed)
    sizes = []
    for i in range(count):
        width, height = int(rng.integers(28, 601)), int(rng.integers(28, 401))
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        base = rng.uniform(0, 255, 3) * (x / width + y / height)[..., None] / 2
        pixels = np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels, "RGB")
        if i % 3 == 0:
            image.save(folder / f"img_{i:04d}.jpg", quality=90)
        else:
            image.save(folder / f"img_{i:04d}.png")
        sizes.append((width, height))
    return sizes


def image_folder(tmp: Path, count: int) -> tuple[Path, list[tuple[int, int]]]:
    """``tmp/images`` with ``count`` images of ``write_images``, and their sizes."""
    images = tmp / "images"
    images.mkdir()
    return images, write_images(images, count)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def encode(tree: Path, images: Path, out: Path, nproc: int, weights: Path,
           part_images: int) -> dict:
    args = ["encode", str(images), "--out", str(out), "--weights", str(weights),
            "--device", "cpu", "--dtype", "float32", "--deterministic", "--overwrite"]
    if part_images:
        args += ["--part-images", str(part_images)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "dsv4enc", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dsv4enc",
               *args, "--timeout", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(tree)}
    load = float(Path("/proc/loadavg").read_text().split()[0])
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                          cwd=tree)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    flat = re.sub(r"\s+", " ", proc.stderr)
    loads = re.search(r"rank loads \S ([\d, ]+?) \(imbalance ([\d.]+)\)", flat)
    return {"wall_s": wall, "load": load, "stderr": proc.stderr,
            "loads": loads.group(1).strip() if loads else "-",
            "imbalance": float(loads.group(2)) if loads else None}


def rows(path: Path):
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["path", "embedding", "error"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (repeatable)")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--weights", type=Path, default=GOLDEN / "ckpt")
    p.add_argument("--part-images", type=int, default=0,
                   help="images per part, each balanced on its own (0: the run's default)")
    p.add_argument("--show-summary", action="store_true", help="print each summary")
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    tmp = Path(tempfile.mkdtemp(prefix="dsv4enc-trees-"))
    try:
        images, sizes = image_folder(tmp, a.images)
        print(f"# {len(sizes)} images, {min(w * h for w, h in sizes)}-"
              f"{max(w * h for w, h in sizes)} pixels, weights {a.weights}", flush=True)
        print(f"| round | tree | processes | wall s | load | rank loads | imbalance | rows "
              f"equal to the first run's |\n|---|---|---|---|---|---|---|---|", flush=True)
        first = None
        for r in range(a.rounds):
            for name, tree in trees.items():
                for nproc in (a.nproc, 1):
                    out = tmp / f"{name}-{nproc}-{r}.parquet"
                    got = encode(Path(tree), images, out, nproc, a.weights, a.part_images)
                    table = rows(out)
                    first = table if first is None else first
                    if a.show_summary:
                        print(got["stderr"], file=sys.stderr)
                    print(f"| {r} | {name} | {nproc} | {got['wall_s']:.1f} | {got['load']} | "
                          f"{got['loads']} | {got['imbalance']} | {table.equals(first)} |",
                          flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
