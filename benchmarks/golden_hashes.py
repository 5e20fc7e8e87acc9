"""Hash the embeddings of the golden images, over the command line's and the API's variants,
so that a change that must not change behaviour can be checked bit for bit.

    python benchmarks/golden_hashes.py [--golden DIR] [--torchrun] > hashes.txt

One line per variant: ``face dtype features pool deterministic sha256``. The command line's
rows are read back from its Parquet output (``path`` and the stored ``embedding`` bytes, in
row order, stored as float32); the API's are the returned tensors' bytes, in input order.
``--torchrun`` adds a 2-rank gloo launch (gathered into one file) on the CPU. Every run pins
the dtype, so nothing depends on what ``--dtype auto`` picks on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(os.environ.get("DSV4ENC_GOLDEN", "/work/shared/golden"))
DTYPES = ("float32", "bfloat16")
FEATURES = ("aligner", "vit")
POOLS = ("none", "mean")
DETERMINISTIC = (True, False)


def parquet_hash(path: Path) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["path", "embedding", "error"])
    digest = hashlib.sha256()
    for key, emb, error in zip(*(table.column(c).to_pylist() for c in table.column_names)):
        digest.update(repr((key, error)).encode())
        digest.update(emb or b"")
    return digest.hexdigest()


def cli_args(images: Path, out: Path, weights: Path, dtype: str, features: str, pool: str,
             deterministic: bool) -> list[str]:
    return ["encode", str(images), "--out", str(out), "--weights", str(weights),
            "--device", "cpu", "--dtype", dtype, "--out-dtype", "float32",
            "--features", features, "--pool", pool,
            "--deterministic" if deterministic else "--no-deterministic", "-q"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "2")
    e["DSV4ENC_CPU_AUTO_DTYPE"] = "float32"
    return e


def cli_hashes(golden: Path, work: Path) -> list[str]:
    lines = []
    for n, (dtype, features, pool, det) in enumerate(
            itertools.product(DTYPES, FEATURES, POOLS, DETERMINISTIC)):
        out = work / f"cli{n}.parquet"
        cmd = [sys.executable, "-m", "dsv4enc",
               *cli_args(golden / "images", out, golden / "ckpt", dtype, features, pool, det)]
        subprocess.run(cmd, check=True, env=env(), capture_output=True)
        lines.append(f"cli {dtype} {features} {pool} {'det' if det else 'nodet'} "
                     f"{parquet_hash(out)}")
    return lines


def api_hashes(golden: Path) -> list[str]:
    import torch

    from dsv4enc import Encoder

    torch.set_num_threads(int(env()["OMP_NUM_THREADS"]))
    images = sorted((golden / "images").iterdir())
    lines = []
    for dtype in DTYPES:
        for det in DETERMINISTIC:
            enc = Encoder.from_pretrained(golden / "ckpt", device="cpu", dtype=dtype,
                                          deterministic=det)
            for features, pool in itertools.product(FEATURES, POOLS):
                digest = hashlib.sha256()
                for emb in enc.encode(images, features=features, pool=pool):
                    digest.update(emb.contiguous().numpy().tobytes())
                lines.append(f"api {dtype} {features} {pool} {'det' if det else 'nodet'} "
                             f"{digest.hexdigest()}")
    return lines


def torchrun_hash(golden: Path, work: Path) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "torchrun.parquet"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "dsv4enc",
           *cli_args(golden / "images", out, golden / "ckpt", "float32", "aligner", "none",
                     True), "--workers", "0", "--timeout", "60"]
    e = env()
    e["OMP_NUM_THREADS"] = "1"
    subprocess.run(cmd, check=True, env=e, capture_output=True, timeout=300)
    return f"torchrun2 float32 aligner none det {parquet_hash(out)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--torchrun", action="store_true", help="add a 2-rank gloo launch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = api_hashes(args.golden) + cli_hashes(args.golden, work)
        if args.torchrun:
            lines.append(torchrun_hash(args.golden, work))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
