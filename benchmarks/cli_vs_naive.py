"""`dsv4enc encode` end to end against a naive loop, the way a user would compare them.

Each round times one pass of the naive loop in this process (decode, transform, per-image
forward with 3-D attention; torch already imported, nothing best-of) and then one
`dsv4enc encode` run as a fresh process (wall-clock: interpreter start, torch import, weights,
decoding, the model and the Parquet file). Rounds alternate the two, so a machine that slows
down mid-way slows both.

    PYTHONPATH=. python benchmarks/cli_vs_naive.py --config configs/medium.json --rounds 3
    PYTHONPATH=. python benchmarks/cli_vs_naive.py --weights CKPT --images FOLDER
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv4enc.bench.throughput import bench_cli, bench_naive, resolve_images
from dsv4enc.tower.checkpoint import build_tower, load_checkpoint, random_state_dict, save_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.defaults import DEFAULT_BATCH_TOKENS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", help="checkpoint folder (default: random weights of --config)")
    p.add_argument("--config", default="configs/medium.json")
    p.add_argument("--images", default="synthetic:mix", help="folder, or synthetic:mix[:N]")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.weights:
            ckpt = Path(a.weights)
        else:
            ckpt = work / "ckpt"
            cfg = VisionConfig.from_file(a.config)
            save_checkpoint(ckpt, cfg, random_state_dict(cfg, 0))
        paths = resolve_images(a.images, work)
        checkpoint = load_checkpoint(ckpt, torch.float32)
        model = build_tower(checkpoint, "cpu")
        ratios = []
        print(f"{len(paths)} images in {paths[0].parent}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        for round_ in range(1, a.rounds + 1):
            began = time.perf_counter()
            bench_naive(model, paths, "aligner", torch.float16, repeat=1)
            naive = time.perf_counter() - began
            encode = bench_cli(checkpoint.config, paths, "cpu", "float32",
                               DEFAULT_BATCH_TOKENS["cpu"], work, None, weights=ckpt)["seconds"]
            ratios.append(naive / encode)
            print(f"round {round_}: naive loop {naive:.2f} s, dsv4enc encode {encode:.2f} s, "
                  f"ratio {ratios[-1]:.2f}x", flush=True)
        print(f"median ratio {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
