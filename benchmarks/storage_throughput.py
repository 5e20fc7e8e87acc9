"""A bucket input against a local input, same images: does reading from object storage keep
up with the local disk?

Starts moto's S3 server (``moto[server]``, the dev extra) in its own process on 127.0.0.1,
uploads the images, then encodes the local folder and the bucket prefix with the host-side
pipeline (``hostbench.NullStage``: the real discovery, header reads, decode workers and
writer; the model replaced by a null stage, so the input side is what is timed). Best of
``--repeat`` rounds each.

    PYTHONPATH=. python benchmarks/storage_throughput.py --images synthetic:1024x768:256 \
        --workers 2 --repeat 2

The server is local, so this measures dsv4enc's own overhead per object (requests, listing,
per-image reads in the workers), not a network's latency or bandwidth.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log=None) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:``port``; ``log``: a file for its request lines."""
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL,
                            stderr=log if log is not None else subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", default="synthetic:1024x768:256")
    parser.add_argument("--config", default="configs/deepseek-v4-flash.json")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    import boto3

    from dsv4enc import storage
    from dsv4enc.bench.throughput import resolve_images
    from dsv4enc.tower.config import VisionConfig
    from dsv4enc.bench.host import NullStage
    from dsv4enc.run.options import EncodeOptions
    from dsv4enc.run.pipeline import run_encode

    port = free_port()
    server = start_server(port)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env)
    storage.configure(None)
    try:
        with tempfile.TemporaryDirectory(prefix="dsv4enc-s3bench-") as scratch:
            base = Path(scratch)
            paths = resolve_images(args.images, base)
            folder = paths[0].parent
            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                                  region_name="us-east-1", aws_access_key_id="bench",
                                  aws_secret_access_key="bench")
            client.create_bucket(Bucket="bench")
            began = time.perf_counter()
            for path in paths:
                client.put_object(Bucket="bench", Key=f"in/{path.relative_to(folder)}",
                                  Body=path.read_bytes())
            upload_s = time.perf_counter() - began
            total_mb = sum(p.stat().st_size for p in paths) / 1e6
            cfg = VisionConfig.from_file(args.config)
            print(f"{len(paths)} images, {total_mb:.1f} MB (uploaded in {upload_s:.1f} s); "
                  f"{args.workers} decode workers; {os.cpu_count()} CPUs; "
                  f"load average {os.getloadavg()[0]:.1f}")
            print("| input | images/s (best) | rounds (s) |")
            print("|---|---|---|")
            for name, source in [("local folder", str(folder)), ("s3:// prefix", "s3://bench/in/")]:
                rounds = []
                for i in range(args.repeat):
                    opts = EncodeOptions(inputs=[source], out=str(base / f"out-{i}.parquet"),
                                         config=args.config, random_init=True, device="cpu",
                                         dtype="float32", out_dtype="float16",
                                         workers=args.workers, overwrite=True, progress=False)
                    start = time.perf_counter()
                    summary = run_encode(replace(opts), stand_in=NullStage(cfg))
                    seconds = time.perf_counter() - start
                    assert summary.encoded == len(paths), summary
                    rounds.append(seconds)
                best = min(rounds)
                shown = ", ".join(f"{s:.2f}" for s in rounds)
                print(f"| {name} | {len(paths) / best:.1f} | {shown} |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
