"""What dsv4enc's manifest costs per committed part, the commit record of `--engine ray`
(and of every run): one atomic JSON write (temporary file, fsync, rename) listing every part
so far, timed with N parts already listed.

    python benchmarks/manifest_cost.py [--parts 100,1000,10000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from dsv4enc.output.parts import PartStore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="100,1000,10000")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="dsv4enc-manifest-"))
    settings = {"tool": "dsv4enc", "part_images": 1024, "config": {"k": 1} }
    for n in (int(v) for v in args.parts.split(",")):
        store = PartStore(folder, settings)
        store.parts = {f"part-{i:06d}": {"file": f"part-{i:06d}.parquet", "start": i * 1024,
                                         "end": (i + 1) * 1024, "digest": "a" * 24 + "." + "b" * 24,
                                         "rows": 1024, "transient": 0} for i in range(n)}
        times = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            store.save()
            times.append(time.perf_counter() - began)
        size = store.manifest_path.stat().st_size
        print(f"{n:>6} parts listed ({n * 1024:,} images at 1024 a part): manifest "
              f"{size / 1024:.0f} KiB, save median {statistics.median(times) * 1e3:.1f} ms "
              f"(min {min(times) * 1e3:.1f})", flush=True)


if __name__ == "__main__":
    main()
