"""Start-up of ``dsv4enc encode`` cold and warm: each variant runs twice in fresh processes
over one folder of generated JPEGs, first with an empty compile cache (``$DSV4ENC_CACHE_DIR``
in a new temporary folder), then again with the cache the first run left.

For each run: the wall time of the process (launch to exit), the encoding loop's seconds and
rate (from ``--summary-json``), and the start-up, everything outside the loop (wall - loop).

    python benchmarks/start_cost.py --device cpu --config configs/tiny.json --images 16
    python benchmarks/start_cost.py --device cuda --config configs/deepseek-v4-flash.json \\
        --images 400 --size 1024x768 --variants default,--no-fused --json start.json

``--variants``: comma-separated; ``default`` is the command with no engine flag, anything
else is passed as extra flags (space-separated, e.g. ``--fused``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def make_images(folder: Path, count: int, size: tuple[int, int]) -> Path:
    """``count`` random-noise JPEGs of ``size`` (width, height) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:05d}.jpg", quality=90)
    return folder


def run_once(images: Path, out: Path, cache: Path, args: argparse.Namespace,
             flags: list[str]) -> dict:
    """One ``encode`` process; its wall time and the summary's loop figures."""
    summary = out.with_suffix(".json")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(DSV4ENC_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out", str(out),
           "--config", args.config, "--random-init", "--device", args.device, "-q",
           "--summary-json", str(summary), *flags]
    began = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    loop = json.loads(summary.read_text())
    return {"wall_s": round(wall, 2), "loop_s": round(loop["seconds"]["encoding"], 2),
            "start_s": round(wall - loop["seconds"]["encoding"], 2),
            "loop_img_per_s": round(loop["rates"]["images_per_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.json"))
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", default="96x64", help="WIDTHxHEIGHT of each JPEG")
    parser.add_argument("--variants", default="--no-fused,--fused")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsv4enc_start_") as tmp:
        images = make_images(Path(tmp) / "images", args.images, size)
        for i, variant in enumerate(args.variants.split(",")):
            flags = [] if variant == "default" else variant.split()
            cache = Path(tmp) / f"cache{i}"
            for run in ("cold", "warm"):
                out = Path(tmp) / f"out{i}_{run}.parquet"
                row = {"variant": variant, "run": run,
                       **run_once(images, out, cache, args, flags)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n| variant | run | wall s | start-up s | loop s | loop img/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['run']} | {r['wall_s']} | {r['start_s']} | {r['loop_s']} "
              f"| {r['loop_img_per_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
