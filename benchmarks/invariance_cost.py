"""What batch-invariant rows cost: the engine with ``deterministic`` on against off.

Same tower, same packed batches, both engines timed batch by batch in alternation (each
batch's best of ``--rounds``), so the machine's load moves both figures alike. Prints one
line per compute dtype: seconds off, seconds on, and the cost in percent.

    PYTHONPATH=. python benchmarks/invariance_cost.py --config configs/medium.json
"""

from __future__ import annotations

import argparse
import time

import torch

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.packing import pack
from dsv4enc.engine.bins import pack_bins
from dsv4enc.tower.transform import plan_canvas

#: Photo sizes of a typical mix (width, height): each gives its grid through the transform.
SIZES = [(1024, 768), (768, 1024), (1920, 1080), (640, 480), (300, 300), (2000, 1500),
         (800, 600), (1280, 720), (500, 1200), (4000, 3000), (1000, 1000), (350, 900)]


def batches_for(cfg, batch_tokens: int, copies: int):
    gen = torch.Generator().manual_seed(0)
    items = []
    for _ in range(copies):
        for w, h in SIZES:
            canvas = plan_canvas(w, h, cfg)
            n = canvas.n_h * canvas.n_w
            items.append((torch.randn(n, cfg.patch_dim, generator=gen).to(torch.bfloat16),
                          canvas.n_h, canvas.n_w))
    bins = pack_bins([h * w for _, h, w in items], batch_tokens)
    return [pack([items[i] for i in b], cfg.downsample_ratio) for b in bins]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/medium.json")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--copies", type=int, default=2, help="copies of the size mix")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = VisionConfig.from_file(args.config)
    batches = batches_for(cfg, args.batch_tokens, args.copies)
    tokens = sum(b.n_tokens for b in batches)
    print(f"{args.config}: {len(batches)} batches, {tokens} tokens, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        tower = build_tower(random_checkpoint(cfg, seed=0, dtype=dtype))
        engines = {False: Engine(tower, deterministic=False),
                   True: Engine(tower, deterministic=True)}
        best = {False: [float("inf")] * len(batches), True: [float("inf")] * len(batches)}
        for e in engines.values():
            e.encode(batches[0])  # warm-up
        for _ in range(args.rounds):
            for i, batch in enumerate(batches):
                for det, e in engines.items():
                    began = time.perf_counter()
                    e.encode(batch)
                    best[det][i] = min(best[det][i], time.perf_counter() - began)
        off, on = sum(best[False]), sum(best[True])
        print(f"{name:9s}: off {off:7.2f} s  on {on:7.2f} s  "
              f"cost {100 * (on / off - 1):+5.1f}%")


if __name__ == "__main__":
    main()
