"""Time to the first committed part, and peak memory then, against the number of inputs.

Makes folders of N tiny PNGs (28x42, the tiny tower's ``configs/tiny.json``) once, as hard
links of a few real files (so 10^6 inputs cost directory entries, not data), then for each N
runs ``dsv4enc encode FOLDER`` as a fresh process that pauses at its first commit
(``dsv4enc.pausepoints``: ``commit``), and reports the seconds from launch to that pause and
the process's peak RSS then (``VmHWM``). The run is killed there, and ``--resume`` of that
interrupted run is measured the same way (its first commit of a part still to do). Nothing
runs the whole encode.

    python benchmarks/first_part.py --counts 1000 100000 1000000 [--root /tmp/dsv4enc_first_part]
    python benchmarks/first_part.py --counts 1000 100000 --code /path/to/other/checkout
    python benchmarks/first_part.py --counts 1000 100000 --part-images 64

``--code``: the dsv4enc tree to run (PYTHONPATH), to compare two versions on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PER_FOLDER = 10_000  # links per sub-folder, so that no folder holds a million entries
SOURCES = 64  # distinct PNGs the links point at (a file takes at most 65,000 links)


def make_inputs(root: Path, count: int) -> Path:
    """A folder of ``count`` PNG links (made once; reused when it is complete)."""
    folder = root / f"n{count}"
    done = folder / ".complete"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    sources = root / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(SOURCES):
        path = sources / f"s{i}.png"
        pixels = rng.integers(0, 256, (42, 28, 3), dtype=np.uint8)
        if not path.exists():
            Image.fromarray(pixels).save(path)
        files.append(path)
    for i in range(count):
        sub = folder / f"d{i // PER_FOLDER:04d}"
        if i % PER_FOLDER == 0:
            sub.mkdir(parents=True)
        os.link(files[i % SOURCES], sub / f"img{i:07d}.png")
    done.touch()
    return folder


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_commit(folder: Path, out: Path, code: Path, *extra: str) -> tuple[float, float]:
    """Seconds from launch to the first commit, and peak RSS (MiB) then; the run is killed."""
    pauses = Path(tempfile.mkdtemp(prefix="pauses-"))
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1",
           "DSV4ENC_PAUSE_AT": "commit", "DSV4ENC_PAUSE_DIR": str(pauses)}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dsv4enc", "encode", str(folder), "--out",
                             str(out), "--config", str(ROOT / "configs/tiny.json"),
                             "--random-init", "--device", "cpu", "--dtype", "float32",
                             "-q", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            cwd=code)  # ``-m`` imports from the working folder first
    try:
        while not (pauses / "commit.1.json").exists():
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            time.sleep(0.005)
        seconds = time.perf_counter() - began
        rss = peak_rss_mib(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(pauses, ignore_errors=True)
    return seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--root", type=Path, default=Path("/tmp/dsv4enc_first_part"))
    parser.add_argument("--code", type=Path, default=ROOT)
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--part-images", type=int, default=None,
                        help="--part-images of the runs (default: the config's, 1024 here)")
    args = parser.parse_args()
    results = []
    for count in args.counts:
        folder = make_inputs(args.root, count)
        extra = ["--part-images", str(args.part_images)] if args.part_images else []
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "e.parquet"
            fresh, fresh_rss = first_commit(folder, out, args.code, *extra)
            row = {"inputs": count, "fresh_s": round(fresh, 2), "fresh_rss_mib": round(fresh_rss)}
            if not args.no_resume:
                resumed, resumed_rss = first_commit(folder, out, args.code, *extra, "--resume")
                row.update(resume_s=round(resumed, 2), resume_rss_mib=round(resumed_rss))
        print(json.dumps(row), flush=True)
        results.append(row)


if __name__ == "__main__":
    main()
