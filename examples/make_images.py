"""Write a small, varied folder of test images for the quickstart.

    python examples/make_images.py [FOLDER]        # default: examples/images/

The folder gets images of different sizes, aspect ratios, modes and formats (JPEG, PNG, WebP,
GIF, BMP, TIFF), a nested sub-folder, one file that is not an image (skipped by ``encode``)
and one broken image (encoded as a row with an ``error``). Pixels come from a fixed seed, so
every run writes the same files. Existing files of the same names are replaced.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

SEED = 1234
DEFAULT_FOLDER = Path(__file__).resolve().parent / "images"

#: (relative path, (width, height), mode); the format follows the suffix.
IMAGES = (
    ("cat.jpg", (320, 240), "RGB"),  # 4:3 photo
    ("banner.png", (1200, 100), "RGB"),  # 12:1, wider than max_wh_ratio: stretched
    ("portrait.webp", (180, 420), "RGB"),  # tall
    ("logo.png", (64, 64), "RGBA"),  # small, with alpha: upscaled to min_pixels
    ("scan.tif", (500, 700), "L"),  # grayscale TIFF
    ("icon.gif", (48, 32), "P"),  # palette
    ("nested/holiday/beach.jpg", (640, 360), "RGB"),  # 16:9 in a sub-sub-folder
    ("nested/sketch.bmp", (150, 150), "RGB"),
)
NOT_AN_IMAGE = ("notes.txt", b"dsv4enc skips files without an image extension.\n")
BROKEN = ("nested/broken.jpg", b"\xff\xd8\xff\xe0 this JPEG stops after its first bytes")


def smooth_image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An RGB array with gradients, a few shapes and a little noise (compresses well and,
    unlike pure noise, looks like something)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    slope = rng.uniform(-1, 1, (3, 2))
    rgb = np.stack([base[c] + 200 * (slope[c, 0] * x / width + slope[c, 1] * y / height)
                    for c in range(3)], axis=-1)
    for _ in range(4):  # discs
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(0.1, 0.4) * min(width, height)
        inside = (x - cx) ** 2 + (y - cy) ** 2 < radius ** 2
        rgb[inside] = rng.uniform(0, 255, 3)
    rgb += rng.normal(0, 6, rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def make_images(folder: Path = DEFAULT_FOLDER, seed: int = SEED) -> list[Path]:
    """Write the example files under ``folder``; returns their paths."""
    rng = np.random.default_rng(seed)
    written = []
    for rel, (width, height), mode in IMAGES:
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(smooth_image(rng, width, height), "RGB")
        if mode == "RGBA":
            alpha = np.full((height, width), 255, np.uint8)
            alpha[: height // 4] = 0  # a transparent band
            image = Image.merge("RGBA", (*image.split(), Image.fromarray(alpha, "L")))
        elif mode == "P":
            image = image.quantize(32)
        elif mode != "RGB":
            image = image.convert(mode)
        image.save(path)
        written.append(path)
    for rel, data in (NOT_AN_IMAGE, BROKEN):
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def main(argv: list[str]) -> None:
    folder = Path(argv[0]) if argv else DEFAULT_FOLDER
    paths = make_images(folder)
    print(f"wrote {len(paths)} files under {folder} ({len(IMAGES)} images, "
          f"1 non-image, 1 broken image)")


if __name__ == "__main__":
    main(sys.argv[1:])
