"""The image transform: bit-exact with the reference on 8-bit images.

``plan_canvas`` maps an image size to its canvas and patch grid without touching pixels, so
grids can be known from image headers alone; ``image_to_patches`` does the pixel work.
The pixel work is numpy only (bf16 bits made by round-to-nearest-even, as torch rounds), so
decode workers never import torch. ``pixels_to_patches`` is the same transform as torch ops
on any device (``tower/resample``: Pillow's resize and pad, exactly), from the 8-bit pixels
that ``image_pixels`` takes of a decoded image."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

from typing import TYPE_CHECKING, Callable

import numpy as np
from PIL import Image, ImageOps

from .config import VisionConfig

if TYPE_CHECKING:
    import torch

PAD_FILL = (127, 127, 127)
_SIXTEEN_BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N"}
_BITS_PER_SAMPLE = 258  # the TIFF tag


@dataclass(frozen=True)
class Canvas:
    """Where an image of a given size goes: canvas pixels, patch grid, resize mode."""

    width: int  # canvas width in pixels (bw)
    height: int  # canvas height in pixels (bh)
    n_w: int  # patch columns
    n_h: int  # patch rows
    stretch: bool  # True: plain resize; False: aspect-preserving pad

    @property
    def n_patches(self) -> int:
        return self.n_h * self.n_w


def llm_grid(bh: int, bw: int, patch: int, ratio: int) -> tuple[int, int]:
    """Rows and columns of merged (LLM) tokens the aligner makes of a (bh, bw) canvas."""
    return math.ceil((bh // patch) / ratio), math.ceil((bw // patch) / ratio)


def count_llm_tokens(bh: int, bw: int, patch: int, ratio: int) -> int:
    """LLM tokens the V4 reference spends on a (bh, bw) canvas: V4.1's, plus an odd-row
    padding row and a parity term."""
    lh, lw = llm_grid(bh, bw, patch, ratio)
    tokens = count_llm_tokens_v41(bh, bw, patch, ratio)
    if lh % 2:
        tokens += lw + 1
    if ((lh + 1) // 2 * (lw + 1)) % 2:
        tokens += 2
    return tokens


def count_llm_tokens_v41(bh: int, bw: int, patch: int, ratio: int) -> int:
    """LLM tokens the V4.1 reference spends on a (bh, bw) canvas: start, each row of tokens
    followed by a newline, end. Nothing else."""
    lh, lw = llm_grid(bh, bw, patch, ratio)
    return lh * (lw + 1) + 2


def _no_pixels_message(width: int, height: int) -> str:
    return f"image has no pixels ({width}x{height})"


def no_pixels(width: int, height: int) -> str | None:
    """The error row's text of a stored size with no pixels (a side of 0 or less), else None:
    ``ErrorType: message`` as every error row's (the ValueError ``plan_canvas`` raises), which
    the summary groups errors by."""
    if width > 0 and height > 0:
        return None
    return f"ValueError: {_no_pixels_message(width, height)}"


def plan_canvas(width: int, height: int, cfg: VisionConfig) -> Canvas:
    """Canvas and patch grid for an image of ``width`` x ``height`` pixels, with the geometry
    of ``cfg.model_type`` (V4 or V4.1). Raises ValueError for a size that has no canvas."""
    if width <= 0 or height <= 0:
        raise ValueError(_no_pixels_message(width, height))
    p = cfg.patch_size
    W, H = width, height
    if cfg.max_wh_ratio is not None and W > H * cfg.max_wh_ratio:
        W = H * cfg.max_wh_ratio
    if 0 < W * H < cfg.min_pixels:
        k = math.sqrt(cfg.min_pixels / (W * H))
        W = int(W * k)
        H = int(H * k)
    if W <= 0 or H <= 0:  # only with max_wh_ratio < 1: the cap can leave under a pixel
        raise ValueError(f"image size {width}x{height} gives an empty canvas")
    bw = math.ceil(W / p) * p
    bh = math.ceil(H / p) * p
    fit = _fit_budget_v41 if cfg.is_v41 else _fit_budget_v4
    bw, bh = fit(W, H, bw, bh, cfg)
    if bw <= 0 or bh <= 0:
        raise ValueError(f"image size {width}x{height} gives an empty canvas")
    stretch = cfg.max_wh_ratio is not None and width >= cfg.max_wh_ratio * height
    return Canvas(width=int(bw), height=int(bh), n_w=int(bw) // p, n_h=int(bh) // p,
                  stretch=stretch)


def _fit_budget_v4(W: float, H: float, bw: int, bh: int, cfg: VisionConfig) -> tuple[int, int]:
    """V4: budget max_n_token - 3, re-solved with a shrinking budget until the canvas fits."""
    p, r = cfg.patch_size, cfg.downsample_ratio
    budget = cfg.max_n_token - 3
    b = budget
    tokens = count_llm_tokens(bh, bw, p, r)
    while tokens > budget:
        q = H / W
        fw = math.sqrt((b - 2) / q + 0.25) - 0.5
        fh = fw * q
        if fw < 1:
            mw = 1
            mh = (b - 2) // (mw + 1)
            if mh % 2:
                mh -= 1
            bw, bh = mw * p * r, mh * p * r
        elif fh < 2:
            mh = 2
            mw = (b - 2) // mh - 1
            bw, bh = mw * p * r, mh * p * r
        else:
            mw = math.floor(fw)
            mh = math.floor(fh)
            if mh % 2:
                mh -= 1
            s = min(mw * p * r / W, mh * p * r / H)
            bw = math.floor(W * s / p) * p
            bh = math.floor(H * s / p) * p
        b -= 1
        tokens = count_llm_tokens(bh, bw, p, r)
    return bw, bh


def _fit_budget_v41(W: float, H: float, bw: int, bh: int, cfg: VisionConfig) -> tuple[int, int]:
    """V4.1: the budget is max_n_token; a canvas over it is solved once, and the solution
    must fit (the reference asserts it)."""
    p, r, budget = cfg.patch_size, cfg.downsample_ratio, cfg.max_n_token
    if count_llm_tokens_v41(bh, bw, p, r) <= budget:
        return bw, bh
    bw, bh = _solve_resize_v41(W, H, p, r, budget)
    if count_llm_tokens_v41(bh, bw, p, r) > budget:
        # Unreachable in practice (the solve spends at most the budget); the reference
        # asserts it, so an image that got here would fail there too.
        raise ValueError(f"the {bw}x{bh} canvas solved for {W}x{H} pixels is over the "
                         f"{budget}-token budget")
    return bw, bh


def _solve_resize_v41(W: float, H: float, p: int, r: int, b: int) -> tuple[int, int]:
    """V4.1's solve_resize_ratio: the largest aspect-preserving canvas whose token grid fits
    ``b``, as (bw, bh). With fw x fh the real-valued grid that spends exactly ``b`` tokens:
    a grid under one cell wide becomes one column of (b-2)//2 cells, one under one cell high
    becomes one row of b-3 cells; otherwise the image is scaled into floor(fw) x floor(fh)
    cells and cut down to whole patches. No row count is forced even (V4 forces it)."""
    cell = p * r
    q = H / W
    fw = math.sqrt((b - 2) / q + 0.25) - 0.5
    fh = fw * q
    if fw < 1:
        return cell, (b - 2) // 2 * cell
    if fh < 1:
        return (b - 3) * cell, cell
    scale = min(math.floor(fw) * cell / W, math.floor(fh) * cell / H)
    return math.floor(W * scale / p) * p, math.floor(H * scale / p) * p


def max_image_tokens(cfg: VisionConfig) -> int:
    """Most patches one transformed image can have: r^2 * (budget - 3), the budget being
    max_n_token - 3 for V4 and max_n_token for V4.1. (A canvas spends at least lh*lw + 3 LLM
    tokens and has n_h*n_w <= r^2 * lh*lw; a very wide V4.1 image reaches the bound.)"""
    budget = cfg.max_n_token if cfg.is_v41 else cfg.max_n_token - 3
    return cfg.downsample_ratio ** 2 * (budget - 3)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with 16-bit samples scaled to 8 bits (>> 8), never clipped. No EXIF rotation."""
    mode = image.mode
    values = np.asarray(image) if mode in _SIXTEEN_BIT_MODES or mode == "I" else None
    if values is not None and (mode != "I" or _sixteen_bit_file(image)
                               or values.max(initial=0) > 255):
        # Pillow's own convert clips 16-bit values to 255; the reference scales them. In the
        # samples' own dtype: a wider temporary (int64) would take 8 bytes per pixel, twice.
        if values.dtype.itemsize > 2:  # mode "I" (int32): keep the 16-bit range
            values = np.clip(values, 0, 65535)
        eight = (values >> 8).astype(np.uint8)
        return Image.fromarray(eight, mode="L").convert("RGB")
    if mode == "RGB":
        return image
    return image.convert("RGB")


def _sixteen_bit_file(image: Image.Image) -> bool:
    """Whether a mode "I" image is a 16-bit TIFF (its BitsPerSample says so), however dark.
    Else only its values tell: older Pillows read 16-bit PNGs as "I", and "L" converts to
    "I" with 8-bit values, so only the former exceed 255."""
    tags = getattr(image, "tag_v2", None)
    return tags is not None and tuple(tags.get(_BITS_PER_SAMPLE) or ()) == (16,)


def image_pixels(image: Image.Image) -> np.ndarray:
    """The 8-bit pixels (h, w, c) of a decoded image that ``pixels_to_patches`` takes: one
    channel for a grey image (its RGB is the grey value thrice, and the pad fill is grey),
    else the three of ``to_rgb``. uint8, C-contiguous."""
    if image.mode == "L":
        return np.asarray(image, dtype=np.uint8)[..., None]
    return np.asarray(to_rgb(image), dtype=np.uint8)


def _normalize_lut() -> np.ndarray:
    """bf16 bits of every 8-bit value's normalized pixel: float32 ``x / 255``, then
    ``(x - 0.5) / 0.5``, each step rounded in float32 as the reference does, then bf16
    (nearest even). One lookup per pixel gives what the arithmetic would, at a quarter of
    its cost."""
    levels = np.arange(256, dtype=np.float32)
    normalized = (levels / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    bits = normalized.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


NORMALIZED_BF16_BITS = _normalize_lut()  # (256,) uint16


def _pair_lut(single: np.ndarray) -> np.ndarray | None:
    """The lookup for two neighbouring bytes at once (half the lookups): entry ``a | b << 8``
    holds the bf16 bits of ``a`` in its low half and of ``b`` in its high half, for a uint16
    view of the pixels and a uint32 view of the output. Both views read memory little-endian:
    on a big-endian host there is no pair table (None)."""
    if sys.byteorder != "little":
        return None
    wide = single.astype(np.uint32)
    return (wide[None, :] | (wide[:, None] << 16)).reshape(-1)  # index a + 256*b: [b, a]


NORMALIZED_BF16_PAIRS = _pair_lut(NORMALIZED_BF16_BITS)  # (65536,) uint32, or None


def normalize_patch_pixels(patch_pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``NORMALIZED_BF16_BITS[patch_pixels]`` (uint8 (n, k), C-contiguous), into ``out``
    (uint16 (n, k)) when given. Rows of even length go through ``NORMALIZED_BF16_PAIRS``."""
    if out is None:
        out = np.empty(patch_pixels.shape, dtype=np.uint16)
    pairs = NORMALIZED_BF16_PAIRS
    if (pairs is not None and patch_pixels.ndim == 2 and patch_pixels.shape[1] % 2 == 0
            and patch_pixels.flags.c_contiguous and out.flags.c_contiguous):
        # mode="clip": a uint16 index never exceeds the 65536-entry table, and the default
        # mode would buffer the whole result and copy it.
        np.take(pairs, patch_pixels.view(np.uint16), out=out.view(np.uint32), mode="clip")
    else:
        np.take(NORMALIZED_BF16_BITS, patch_pixels, out=out, mode="clip")
    return out


def contained_size(width: int, height: int, size: tuple[int, int]) -> tuple[int, int]:
    """ImageOps.contain's size for a ``width`` x ``height`` image in ``size``: the largest
    that keeps the aspect ratio, each side rounded as Python rounds (ties to even)."""
    im_ratio, dest_ratio = width / height, size[0] / size[1]
    if im_ratio > dest_ratio:
        return size[0], round(height / width * size[0])
    if im_ratio < dest_ratio:
        return round(width / height * size[1]), size[1]
    return size


def image_to_patch_bits(image: Image.Image, cfg: VisionConfig,
                        out: Callable[[tuple[int, int]], np.ndarray | None] | None = None,
                        ) -> tuple[np.ndarray, Canvas]:
    """A decoded image's patches as bfloat16 bits: ``(bits, canvas)``, bits uint16 (n_h*n_w,
    3*p*p), each patch channel-major (c, y, x), rows in raster order. ``out(shape)`` may give
    the array to write into (a decode worker's shared-memory slot: no copy afterwards); when
    it gives None, or there is no ``out``, a new array is made."""
    rgb = to_rgb(image)
    canvas = plan_canvas(rgb.width, rgb.height, cfg)
    size = (canvas.width, canvas.height)
    if canvas.stretch:
        fitted = rgb.resize(size)
    elif min(contained_size(rgb.width, rgb.height, size)) == 0:  # Pillow < 13's pad raises
        fitted = Image.new("RGB", size, PAD_FILL)  # only the fill shows, as Pillow 13 pads
    else:
        fitted = ImageOps.pad(rgb, size, color=PAD_FILL)
    pixels = np.asarray(fitted, dtype=np.uint8)  # (bh, bw, 3)
    p = cfg.patch_size
    # Patchify the 1-byte pixels (the reshape copies them into patch order), then normalize
    # by lookup straight into the final layout.
    patch_pixels = (pixels.transpose(2, 0, 1)  # (3, bh, bw)
                    .reshape(3, canvas.n_h, p, canvas.n_w, p)
                    .transpose(1, 3, 0, 2, 4)  # (n_h, n_w, 3, p, p)
                    .reshape(canvas.n_patches, 3 * p * p))
    target = out((canvas.n_patches, 3 * p * p)) if out is not None else None
    return normalize_patch_pixels(np.ascontiguousarray(patch_pixels), target), canvas


def bf16_bits_to_tensor(bits: np.ndarray) -> "torch.Tensor":
    """View uint16 bf16 bits as a bfloat16 torch tensor (shares memory)."""
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def image_to_patches(image: Image.Image, cfg: VisionConfig) -> tuple["torch.Tensor", Canvas]:
    """``image_to_patch_bits`` as a bfloat16 tensor: ``(patches, canvas)``."""
    bits, canvas = image_to_patch_bits(image, cfg)
    return bf16_bits_to_tensor(bits), canvas


def pixels_to_patches(pixels: "torch.Tensor", cfg: VisionConfig) -> tuple["torch.Tensor", Canvas]:
    """``image_to_patches`` as torch ops on ``pixels``' device, bit for bit: uint8 pixels
    (h, w, c), c 1 (grey) or 3, as ``image_pixels`` gives them -> ``(patches, canvas)``,
    patches (n_h*n_w, 3*p*p) bfloat16 on the same device."""
    import torch

    from .resample import pad, resize

    height, width, channels = (int(n) for n in pixels.shape)
    canvas = plan_canvas(width, height, cfg)
    size = (canvas.width, canvas.height)
    fitted = (resize(pixels, size) if canvas.stretch
              else pad(pixels, size, PAD_FILL[:channels], contained_size(width, height, size)))
    p = cfg.patch_size
    patch_pixels = (fitted.expand(-1, -1, 3).permute(2, 0, 1)  # (3, bh, bw)
                    .reshape(3, canvas.n_h, p, canvas.n_w, p)
                    .permute(1, 3, 0, 2, 4)  # (n_h, n_w, 3, p, p)
                    .reshape(canvas.n_patches, 3 * p * p))
    table = _normalize_table(pixels.device)
    return table[patch_pixels.to(torch.int64)].view(torch.bfloat16), canvas


@functools.cache
def _normalize_table(device: "torch.device") -> "torch.Tensor":
    """``NORMALIZED_BF16_BITS`` on ``device`` (int16, (256,)), copied there once."""
    import torch

    return torch.from_numpy(NORMALIZED_BF16_BITS.view(np.int16)).to(device)
