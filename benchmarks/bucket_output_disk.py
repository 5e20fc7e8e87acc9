"""A folder output in a bucket: how much local disk a run takes, and how many part objects a
``--resume`` reads.

Starts moto's S3 server (``moto[server]``, the dev extra) on 127.0.0.1, uploads synthetic
images, then runs ``dsv4enc encode s3://…/in/ --out s3://…/out/`` (the tiny config, random
weights, on the CPU) in a subprocess whose ``TMPDIR`` is a fresh folder, sampling that
folder's bytes every few milliseconds (the staging folder and any upload in flight). Then it
runs the same command with ``--resume`` and counts the server's GET requests for part objects,
then adds ``--new`` inputs and runs it with ``--update`` (the peak again, and the part objects
it uploads).
Run it from the tree to measure (``PYTHONPATH`` names the tree whose dsv4enc runs):

    PYTHONPATH=. python benchmarks/bucket_output_disk.py --images synthetic:256x256:300 \
        --part-images 10
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from storage_throughput import free_port, start_server


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``, a file with several links once."""
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # removed while it was looked at
            sizes[st.st_dev, st.st_ino] = st.st_size
    return sum(sizes.values())


def encode(command: list[str], env: dict, tmp: Path) -> int:
    """Run ``command`` with ``TMPDIR=tmp``; the most bytes ``tmp`` held meanwhile."""
    proc = subprocess.Popen(command, env={**env, "TMPDIR": str(tmp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, folder_bytes(tmp))
        time.sleep(0.005)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr.read()[-3000:])
    return peak


def part_requests(log, method: str, run) -> tuple[int, int]:
    """The ``method`` requests for part objects that the server logged while ``run()`` ran,
    and what ``run()`` returned."""
    log.flush()
    before = Path(log.name).read_text(errors="replace").count("\n")
    returned = run()
    lines = Path(log.name).read_text(errors="replace").splitlines()[before:]
    pattern = rf'"(\x1b\[[0-9;]*m)*{method} /bench/out/part-[^ ?]*\.parquet'  # some coloured
    return sum(1 for line in lines if re.search(pattern, line)), returned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", default="synthetic:256x256:300")
    parser.add_argument("--part-images", type=int, default=10)
    parser.add_argument("--new", type=int, default=5, help="new inputs for the --update")
    args = parser.parse_args()

    import boto3

    from dsv4enc.bench.throughput import resolve_images

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="dsv4enc-moto-", suffix=".log", delete=False)
    server = start_server(port, log)
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "OMP_NUM_THREADS": "1"}
    try:
        with tempfile.TemporaryDirectory(prefix="dsv4enc-diskbench-") as scratch:
            base = Path(scratch)
            paths = resolve_images(args.images, base / "images")
            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                                  region_name="us-east-1", aws_access_key_id="bench",
                                  aws_secret_access_key="bench")
            client.create_bucket(Bucket="bench")
            for path in paths:
                client.upload_file(str(path), "bench", f"in/{path.name}")
            command = [sys.executable, "-m", "dsv4enc", "encode", "s3://bench/in/",
                       "--out", "s3://bench/out/", "--config", "configs/tiny.json",
                       "--random-init", "--device", "cpu", "--workers", "1", "-q",
                       "--part-images", str(args.part_images)]
            (base / "tmp").mkdir()
            peak = encode(command, env, base / "tmp")
            listed = client.list_objects_v2(Bucket="bench", Prefix="out/part-")
            parts = [o for o in listed.get("Contents", [])]
            output = sum(o["Size"] for o in parts)
            part_gets, _ = part_requests(log, "GET", lambda: encode(
                [*command, "--resume"], env, base / "tmp"))
            print(f"{len(paths)} images, {len(parts)} part objects, {output / 1e6:.2f} MB in "
                  f"the bucket; the run's TMPDIR peaked at {peak / 1e6:.3f} MB "
                  f"({peak / output:.1%} of the output); --resume sent {part_gets} GETs "
                  f"for part objects")
            for path in paths[:args.new]:  # new inputs that sort first: "new-..." < "img..."
                client.upload_file(str(path), "bench", f"in/new-{path.name}")
            puts, peak = part_requests(log, "PUT", lambda: encode(
                [*command, "--update"], env, base / "tmp"))
            print(f"--update with {args.new} new inputs sorting first: TMPDIR peaked at "
                  f"{peak / 1e6:.3f} MB ({peak / output:.1%} of the output); {puts} part "
                  f"objects uploaded")
    finally:
        server.kill()
        server.wait()
        os.unlink(log.name)


if __name__ == "__main__":
    main()
