"""One thread's CPU time per image for the transform: Pillow's path (the decode workers') against
the same transform as torch integer ops on the CPU (``--transform device`` on a CPU device).
Both give the same bytes; ``--transform auto`` keeps Pillow on the CPU when it is faster.

    python benchmarks/transform_cost.py --config configs/deepseek-v4-flash.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image

from dsv4enc.tower.config import VisionConfig
from dsv4enc.tower.transform import image_pixels, image_to_patch_bits, pixels_to_patches


def cpu_ms(fn, repeat: int) -> float:
    """This thread's CPU milliseconds per call, after one call untimed."""
    fn()
    began = time.thread_time()
    for _ in range(repeat):
        fn()
    return (time.thread_time() - began) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/deepseek-v4-flash.json")
    p.add_argument("--sizes", default="1024x768,640x480,1600x1200")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = VisionConfig.from_file(a.config)
    rng = np.random.default_rng(0)
    for size in a.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        pixels = torch.from_numpy(image_pixels(image).copy())
        pillow = cpu_ms(lambda: image_to_patch_bits(image, cfg), a.repeat)
        torch_ms = cpu_ms(lambda: pixels_to_patches(pixels, cfg), a.repeat)
        print(f"{size}: Pillow {pillow:.1f} ms, torch on the CPU {torch_ms:.1f} ms "
              f"({torch_ms / pillow:.1f}x Pillow's)", flush=True)


if __name__ == "__main__":
    main()
