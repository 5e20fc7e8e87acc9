"""``dsv4enc bench --host`` (the run with a null model stage), one source tree against
another, interleaved.

Writes a folder of mixed-size PNGs and JPEGs (``torchrun_trees.image_folder``, fixed seed),
then runs ``python -m dsv4enc bench --host`` on it with each ``--tree`` first on PYTHONPATH,
tree after tree within a round, the order flipping each round, so that load on a shared
machine hits both alike. Reads the bench's own JSON rows (img/s, CPU seconds, images per
CPU-second, steady state) and prints a Markdown table and each tree's medians.

    python benchmarks/host_trees.py --tree old=/work/wt/old --tree new=/work/main --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torchrun_trees import image_folder

ROOT = Path(__file__).resolve().parents[1]


def host_bench(tree: Path, images: Path, config: Path, workers: int, json_out: Path) -> dict:
    cmd = [sys.executable, "-m", "dsv4enc", "bench", "--host", "--config", str(config),
           "--images", str(images), "--outputs", "file", "--workers", str(workers),
           "--json", str(json_out)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    load = float(Path("/proc/loadavg").read_text().split()[0])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
                         f"{proc.stdout[-3000:]}")
    row = json.loads(json_out.read_text())[0]
    return {**row, "load": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (repeatable)")
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "medium.json")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    tmp = Path(tempfile.mkdtemp(prefix="dsv4enc-host-"))
    try:
        images, _ = image_folder(tmp, a.images)
        print(f"# {a.images} images, config {a.config.name}, {a.workers} decode workers",
              flush=True)
        print("| round | tree | load | img/s | CPU s | images per CPU-s | steady images per "
              "CPU-s |\n|---|---|---|---|---|---|---|", flush=True)
        seen: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                row = host_bench(Path(trees[name]), images, a.config.resolve(), a.workers,
                                 tmp / f"{name}.json")
                seen[name].append(row)
                print(f"| {r} | {name} | {row['load']} | {row['img_s']:.1f} | "
                      f"{row['cpu_s']:.2f} | {row['images'] / row['cpu_s']:.1f} | "
                      f"{row.get('steady_img_per_cpu_s') or 0:.1f} |", flush=True)
        for name, rows in seen.items():
            rates = [row["img_s"] for row in rows]
            per_cpu = [row["images"] / row["cpu_s"] for row in rows]
            print(f"# {name}: img/s median {statistics.median(rates):.1f} "
                  f"({min(rates):.1f}-{max(rates):.1f}); images per CPU-s median "
                  f"{statistics.median(per_cpu):.1f} ({min(per_cpu):.1f}-{max(per_cpu):.1f})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
