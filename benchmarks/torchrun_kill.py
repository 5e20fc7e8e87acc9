"""Torchrun with a rank SIGKILLed midway: what was committed, and what ``--resume`` redoes.

Writes a folder of mixed-size PNGs and JPEGs (``torchrun_trees.write_images``, fixed seed),
runs ``dsv4enc encode`` under ``torchrun --nproc-per-node 2`` (gloo, CPU, float32,
``OMP_NUM_THREADS=1``) with ``--commit-every``, SIGKILLs rank 1 once the run has encoded for
``--kill-after`` seconds (counted from its opening line), then runs the same command with
``--resume`` under torchrun. Prints the committed parts and rows the kill left, and the images
and encoding seconds of the resumed run. ``--tree`` puts another source tree first on
PYTHONPATH (to compare against an older commit).

    python benchmarks/torchrun_kill.py --images 240 --commit-every 5 --kill-after 30
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_trees import write_images  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(tree: Path, folder: Path, out: Path, args, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "dsv4enc",
            "encode", str(folder), "--out", str(out), "--config",
            str(REPO / "configs" / f"{args.config}.json"), "--random-init", "--device", "cpu",
            "--dtype", "float32", "--workers", "1", "--commit-every", str(args.commit_every),
            "--log-every", "1", *extra]


def rank_pid(parent: int, rank: int) -> int | None:
    """The process under ``parent`` (its descendants) whose environment has RANK=``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            chain = int(entry.name)
            while chain > 1:
                if chain == parent:
                    break
                chain = int((Path("/proc") / str(chain) / "stat").read_text()
                            .rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if chain == parent and int(entry.name) != parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)  # (environ's entries are whole: LOCAL_RANK=... is another)
    return None


def killed_run(tree: Path, folder: Path, out: Path, args, log: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(command(tree, folder, out, args), env=env, stderr=stderr,
                                stdout=subprocess.DEVNULL, cwd=out.parent)  # not this tree
        while "dsv4enc: encoding " not in log.read_text():
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(args.kill_after)
        victim = rank_pid(proc.pid, 1)
        assert victim is not None and proc.poll() is None, "no rank 1 to kill"
        progress = [line for line in log.read_text().splitlines()
                    if line.startswith("dsv4enc: images ")]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
    manifest = out.with_name(out.name + ".partial") / "_manifest.json"
    sys.path.insert(0, str(tree))
    from dsv4enc.output.read import load_manifest

    parts = load_manifest(manifest)["parts"] if manifest.is_file() else {}
    return {"exit": proc.returncode, "ended_s": time.monotonic() - killed,
            "progress_at_kill": progress[-1] if progress else "",
            "parts": len(parts), "rows": sum(p["rows"] for p in parts.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO)
    parser.add_argument("--images", type=int, default=240)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--commit-every", type=float, default=5.0)
    parser.add_argument("--kill-after", type=float, default=30.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torchrun-kill-"))
    folder = work / "imgs"
    folder.mkdir()
    write_images(folder, args.images)
    out = work / "out.parquet"
    left = killed_run(args.tree, folder, out, args, work / "killed.log")
    print(json.dumps({"killed": left}, indent=1))
    report = work / "resume.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(args.tree)}
    resumed = subprocess.run(command(args.tree, folder, out, args, "--resume", "-q",
                                     "--summary-json", str(report)),
                             env=env, capture_output=True, text=True, cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(report.read_text())
    print(json.dumps({"resumed": {"reused": summary["images"]["reused"],
                                  "encoded": summary["images"]["encoded"],
                                  "failed": summary["images"]["failed"],
                                  "encoding_s": round(summary["seconds"]["encoding"], 1),
                                  "wall_s": round(summary["seconds"]["wall"], 1)}}, indent=1))
    print(f"work folder: {work}")


if __name__ == "__main__":
    main()
