"""The CPU rate of each compute dtype: float32 against bfloat16 matmuls, or the whole tower.

    python benchmarks/cpu_dtype_rate.py --matmul --rounds 4
    python benchmarks/cpu_dtype_rate.py --matmul --rounds 4 --busy 1

``--matmul``: float32 and bfloat16 matmuls of the encoder's shape (1024x4096 @ 4096x1024),
interleaved round by round in one process, so that both see the same machine; prints each
round's GFLOP/s, the bfloat16/float32 ratio of the medians, this CPU's kind (vendor, family,
model, bf16 features) and what ``--dtype auto`` picks on it (``dsv4enc bench --dtype-check``
times the same products and says it in words). ``--busy N`` keeps N other processes spinning
meanwhile (a loaded machine). These figures are what ``engine/cpufeatures.MEASURED_KINDS`` is
built from.

The tower at a config's real dimensions (random weights), per compute dtype:

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
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsv4enc.bench.dtype_check import MATMUL_SHAPE, matmul_rates
from dsv4enc.bench.throughput import synthetic_images
from dsv4enc.tower.checkpoint import COMPUTE_DTYPES, build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.cpufeatures import auto_cpu_dtype, cpu_decision, machine_answers
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.packing import pack
from dsv4enc.run.plan import image_flops
from dsv4enc.tower.transform import image_to_patches


def _seconds_per_image(engine: Engine, items: list) -> float:
    began = time.perf_counter()
    for patches, n_h, n_w in items:
        engine.encode(pack([(patches, n_h, n_w)], engine.cfg.downsample_ratio))
    return (time.perf_counter() - began) / len(items)


def matmul_main(a: argparse.Namespace) -> None:
    shape = tuple(int(v) for v in a.shape.split(","))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        result = matmul_rates(a.rounds, a.repeat, shape)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    answers = machine_answers()
    dtype, why = cpu_decision(answers)
    print(json.dumps({**result, "busy": a.busy, "threads": torch.get_num_threads(),
                      "cpu": answers.described(), "features": dict(answers.features),
                      "kernel_level": answers.kernel_level,
                      "onednn_max_isa": answers.onednn_max_isa, "torch": torch.__version__,
                      "auto": str(dtype).removeprefix("torch."), "why": why}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--matmul", action="store_true", help="time bare matmuls, both dtypes")
    p.add_argument("--rounds", type=int, default=4, help="--matmul: interleaved rounds")
    p.add_argument("--repeat", type=int, default=5, help="--matmul: products per timing")
    p.add_argument("--shape", default=",".join(map(str, MATMUL_SHAPE)), help="--matmul: M,K,N")
    p.add_argument("--busy", type=int, default=0, help="--matmul: spinning processes")
    p.add_argument("--config")
    p.add_argument("--dtype", default="float32", choices=sorted(COMPUTE_DTYPES))
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--size", default="1024x768")
    p.add_argument("--layers", type=int, default=None, help="build only this many layers")
    p.add_argument("--warmup", action="store_true", help="encode the first image once first")
    a = p.parse_args()
    if a.matmul:
        return matmul_main(a)
    if not a.config:
        p.error("--config is needed (or --matmul)")
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
        "native_bf16": dict(machine_answers().features), "auto_dtype": str(auto_cpu_dtype()),
    }))


if __name__ == "__main__":
    main()
