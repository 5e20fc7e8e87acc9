"""The tower's CPU rate at a config's real dimensions (random weights), per compute dtype.

    python benchmarks/cpu_dtype_rate.py --config configs/deepseek-v4-flash.json \
        --dtype float32 --images 2
    python benchmarks/cpu_dtype_rate.py --config configs/deepseek-v4-flash.json \
        --dtype bfloat16 --images 1 --layers 1

Images are 1024x768 photo-like JPEGs (``bench.synthetic_images``), transformed once, then
encoded one at a time by the Engine on the CPU (as ``dsv4enc encode`` does on the CPU). With
``--layers N`` only N layers are built and timed, and the full-depth time per image is
extrapolated at the FLOP rate the shallow tower achieved: for dtypes too slow to run whole, such as bfloat16 emulated on a
CPU without AMX or AVX512-BF16. No warm-up unless ``--warmup``: the first image's kernel
creation and first-touch memory count. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsv4enc.bench.throughput import synthetic_images
from dsv4enc.tower.checkpoint import COMPUTE_DTYPES, build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.cpufeatures import auto_cpu_dtype, cpu_capabilities
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.packing import pack
from dsv4enc.run.plan import image_flops
from dsv4enc.tower.transform import image_to_patches


def _seconds_per_image(engine: Engine, items: list) -> float:
    began = time.perf_counter()
    for patches, n_h, n_w in items:
        engine.encode(pack([(patches, n_h, n_w)], engine.cfg.downsample_ratio))
    return (time.perf_counter() - began) / len(items)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(COMPUTE_DTYPES))
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--size", default="1024x768")
    p.add_argument("--layers", type=int, default=None, help="build only this many layers")
    p.add_argument("--warmup", action="store_true", help="encode the first image once first")
    a = p.parse_args()
    from PIL import Image

    full = VisionConfig.from_file(a.config)
    cfg = replace(full, n_layers=a.layers) if a.layers else full
    dtype = COMPUTE_DTYPES[a.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        paths = synthetic_images(Path(tmp), f"{a.size}:{a.images}")
        items = []
        for path in paths:
            with Image.open(path) as image:
                patches, canvas = image_to_patches(image.convert("RGB"), cfg)
            items.append((patches, canvas.n_h, canvas.n_w))
    engine = Engine(build_tower(random_checkpoint(cfg, 0, dtype)), features="aligner",
                    out_dtype=torch.float16)
    if a.warmup:  # kernel creation, first-touch memory
        _seconds_per_image(engine, items[:1])
    per_image = _seconds_per_image(engine, items)
    flops = sum(image_flops(full, n_h, n_w) for _, n_h, n_w in items) / len(items)
    if a.layers:  # the full tower at the rate (FLOP/s) the shallow one achieved
        run = sum(image_flops(cfg, n_h, n_w) for _, n_h, n_w in items) / len(items)
        per_image *= flops / run
    print(json.dumps({
        "config": a.config, "dtype": a.dtype, "images": a.images, "size": a.size,
        "layers_run": cfg.n_layers, "layers": full.n_layers, "extrapolated": bool(a.layers),
        "s_per_image": round(per_image, 2), "img_s": round(1 / per_image, 4),
        "gflop_s": round(flops / per_image / 1e9, 2), "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "native_bf16": cpu_capabilities(), "auto_dtype": str(auto_cpu_dtype()),
    }))


if __name__ == "__main__":
    main()
