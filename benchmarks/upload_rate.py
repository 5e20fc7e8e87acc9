"""One object written to a bucket: botocore's client (``storage._put``: one PUT, or a multipart
upload in parallel parts completed at the end) against pyarrow's output stream, interleaved.

Starts moto's S3 server (``moto[server]``, the dev extra) on 127.0.0.1 and uploads the same
file (random bytes, the size of a 64-image part of float16 rows) each way, ``--repeat`` times.

    PYTHONPATH=. python benchmarks/upload_rate.py --megabytes 176 --repeat 5

The server is local and single-process, so this measures the client's own cost and the
server's ingest, not a network's bandwidth or latency (where parts in parallel matter most).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from storage_throughput import free_port, start_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=176)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import boto3

    port = free_port()
    server = start_server(port)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    from dsv4enc import storage

    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        with tempfile.NamedTemporaryFile() as file:
            file.write(os.urandom(args.megabytes << 20))
            file.flush()
            ways = {"botocore (storage._put)": lambda url: storage._put(
                        url, lambda: open(file.name, "rb")),
                    "pyarrow stream": lambda url: storage._copy(
                        url, lambda: open(file.name, "rb"),
                        lambda: storage.filesystem(url)[0].open_output_stream(
                            storage.filesystem(url)[1]))}
            seconds = {name: [] for name in ways}
            for round_ in range(args.repeat):
                for name, upload in ways.items():
                    began = time.perf_counter()
                    upload(f"s3://bench/round{round_}/{len(seconds[name])}.bin")
                    seconds[name].append(time.perf_counter() - began)
        for name, times in seconds.items():
            rates = [args.megabytes / s for s in times]
            print(f"{name}: median {statistics.median(rates):.0f} MB/s "
                  f"(by round: {', '.join(f'{r:.0f}' for r in rates)})")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
