"""`dsv4enc encode --engine ray` against the local engine on the same images, interleaved.

    python benchmarks/ray_engine.py [--config configs/medium.json] [--images 24] [--pairs 2]
        [--size 1024x768] [--out file|folder]

Writes N synthetic photos of `--size` (`dsv4enc bench`'s source), then runs, `--pairs` times
in turn, `dsv4enc encode` (local engine) and `dsv4enc encode --engine ray` (one encoder actor
on a local Ray of 2 CPUs that this script starts once and the runs join with
`--ray-address`) as fresh processes: random weights of the config, CPU, float32 compute,
float16 rows, one output file (or folder) each. Reads each run's encoding-loop rate and wall
time from --summary-json, and the bytes the command's own process wrote (`/proc/PID/io`
`write_bytes`, read once it has exited, before it is reaped) against the output's size;
prints one line per run and the ratios (ray / local), and checks that every run wrote the
same rows. The Ray is started apart so that the driver's count is its own: a process's
`write_bytes` includes its reaped children's, and a Ray the command starts is its child.
Ray's workers run at the script's priority (`RAY_worker_niceness=0`), as the local engine
does, instead of Ray's default 15, which on a shared machine measures the other load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from dsv4enc.bench.throughput import synthetic_images


CLUSTER = """
import sys, ray
ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
         log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


def start_ray() -> tuple[subprocess.Popen, str]:
    """A local Ray in a process of its own (it ends when its stdin closes), and its address."""
    env = {**os.environ, "RAY_worker_niceness": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    return proc, proc.stdout.readline().strip()


def encode(images: Path, out: Path, config: str, engine: str, folder: bool = False,
           address: str = "") -> dict:
    summary = out.with_suffix(".json")
    args = [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out",
            str(out) + ("/" if folder else ""),
            "--config", config, "--random-init", "--device", "cpu", "--dtype", "float32",
            "-q", "--summary-json", str(summary)]
    if engine == "ray":
        args += ["--engine", "ray", "--ray-address", address]
    began = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    written = own_write_bytes(proc.pid)
    assert proc.wait() == 0, f"{engine} run failed"
    wall = time.perf_counter() - began
    done = json.loads(summary.read_text())
    n = done["images"]["encoded"] + done["images"]["failed"]
    size = (sum(p.stat().st_size for p in out.iterdir() if p.is_file()) if out.is_dir()
            else out.stat().st_size)
    return {"engine": engine, "loop": done["rates"]["images_per_s"], "wall": n / wall,
            "wall_s": wall, "images": n, "written": written, "size": size}


def own_write_bytes(pid: int) -> int:
    """What process ``pid`` itself sent to storage (``write_bytes`` of ``/proc/PID/io``)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/PID/io")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/medium.json")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--size", default="1024x768")
    parser.add_argument("--out", choices=("file", "folder"), default="file")
    args = parser.parse_args()
    config = str(Path(args.config).resolve())
    root = Path(tempfile.mkdtemp(prefix="dsv4enc-rayengine-"))
    images = root / "images"
    synthetic_images(images, f"{args.size}:{args.images}")
    runs: list[dict] = []
    cluster, address = start_ray()
    try:
        run_pairs(args, root, images, config, address, runs)
    finally:
        cluster.stdin.close()
        cluster.wait()
    for key in ("loop", "wall"):
        ratios = [ray[key] / local[key] for local, ray in zip(runs[0::2], runs[1::2])]
        print(f"ray/local {key}: median {statistics.median(ratios):.2f} "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")


def run_pairs(args, root: Path, images: Path, config: str, address: str, runs: list) -> None:
    reference = None
    for pair in range(args.pairs):
        for engine in ("local", "ray"):
            out = root / f"{engine}-{pair}" if args.out == "folder" else \
                root / f"{engine}-{pair}.parquet"
            run = encode(images, out, config, engine, folder=args.out == "folder",
                         address=address)
            table = pq.read_table(out)
            reference = table if reference is None else reference
            run["same_bytes"] = table.equals(reference)
            runs.append(run)
            print(f"{engine:5s} pair {pair}: loop {run['loop']:.3f} img/s, wall "
                  f"{run['wall']:.3f} img/s ({run['wall_s']:.1f}s), same rows "
                  f"{run['same_bytes']}; the command's process wrote "
                  f"{run['written'] / 1e6:.1f} MB for {run['size'] / 1e6:.1f} MB of output "
                  f"({100 * run['written'] / max(run['size'], 1):.0f}%)", flush=True)


if __name__ == "__main__":
    main()
