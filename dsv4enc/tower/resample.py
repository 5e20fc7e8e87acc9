"""Pillow's bicubic resize and ImageOps.pad of 8-bit images, as integer torch tensor ops
that give Pillow's bytes exactly, on any device.

Pillow (its Resample.c, 8 bits per channel) computes each output pixel's filter weights in
double, normalizes them to sum to one, rounds them to fixed point with ``PRECISION_BITS``
fraction bits, and sums pixel * weight in 32-bit integers from a half-unit start; the sum is
shifted back and clipped to 0-255. It resizes along one axis, clipping to 8 bits, then along
the other (``vertical_first`` says which goes first), and skips a pass whose size does not
change. The weights here are made the same way on the host (numpy float64, one small table
per size pair); the sums run on the device. No box and no reducing_gap: Image.resize and
ImageOps.pad as the transform calls them use neither."""

from __future__ import annotations

import functools

import numpy as np
import PIL
import torch

#: Fraction bits of Pillow's fixed-point weights: 32 bits less 8 for the pixel and 2 spare
#: (the weights of a filter with negative lobes can sum past one on the way).
PRECISION_BITS = 32 - 8 - 2
BICUBIC_SUPPORT = 2.0  # the kernel is zero from 2 input pixels away (before scaling)
_A = -0.5  # Pillow's bicubic "a" (Keys' kernel)


def bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic kernel at ``x`` (float64), in its C code's order of operations."""
    x = np.abs(x)
    near = ((_A + 2.0) * x - (_A + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * _A
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=512)
def coefficients(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis's resize from ``in_size`` to ``out_size`` pixels: ``(index, weights)``, both
    (out_size, ksize) on the CPU, index int64 (the input pixel each weight reads), weights
    int32 (Pillow's fixed point; zero past each window, whose index is clamped into the
    image). Cached: a run sees few distinct size pairs."""
    scale = float(np.float32(in_size)) / out_size  # Pillow's box edge is a C float
    filterscale = max(scale, 1.0)
    support = BICUBIC_SUPPORT * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale  # (out,)
    # C's (int) cast truncates towards zero; a negative start is then clamped to 0 anyway.
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
    taps = np.arange(ksize, dtype=np.int64)
    inside = taps[None, :] < xmax[:, None]  # (out, ksize)
    positions = (taps[None, :] + xmin[:, None]).astype(np.float64)
    weights = np.where(inside, bicubic((positions - center[:, None] + 0.5) * (1.0 / filterscale)),
                       0.0)
    total = np.zeros(out_size, dtype=np.float64)
    for tap in range(ksize):  # summed tap by tap, in Pillow's order (not numpy's pairwise)
        total += weights[:, tap]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None],
                       weights)
    scaled = weights * float(1 << PRECISION_BITS)
    fixed = np.trunc(np.where(weights < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.minimum(positions.astype(np.int64), in_size - 1)
    return torch.from_numpy(index), torch.from_numpy(fixed)


@functools.lru_cache(maxsize=512)
def coefficients_on(in_size: int, out_size: int, device: torch.device,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``coefficients`` copied to ``device`` once: a pageable copy would wait at every image."""
    return tuple(t.to(device) for t in coefficients(in_size, out_size))


def resample_axis(pixels: torch.Tensor, out_size: int, dim: int,
                  at_once: bool | None = None) -> torch.Tensor:
    """One pass of Pillow's resize along ``dim`` (0: rows, 1: columns) of uint8 pixels
    (h, w, c) to ``out_size``, summed in int32 as Pillow does (its weights never overflow).
    ``at_once``: every output pixel's whole window in one go (a few kernels, for a GPU), else
    one tap at a time (less memory traffic, for a CPU); None: at once off the CPU. Integer
    sums are exact in any order: both give the same bytes."""
    index, weights = coefficients_on(int(pixels.shape[dim]), out_size, pixels.device)
    if at_once is None:
        at_once = pixels.device.type != "cpu"
    acc = (_sums_at_once if at_once else _sums_by_tap)(pixels, index, weights, dim)
    return (acc >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def _sums_at_once(pixels: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  dim: int) -> torch.Tensor:
    """``resample_axis``'s int32 sums, every window gathered at once: (.., out, ksize, ..)."""
    out_size, taps = index.shape
    shape = list(pixels.shape)
    shape[dim:dim + 1] = [out_size, taps]
    window = pixels.index_select(dim, index.reshape(-1)).to(torch.int32).view(shape)
    tap_weights = weights.view([out_size, taps] + [1] * (len(shape) - dim - 2))
    acc = (window * tap_weights).sum(dim + 1, dtype=torch.int32)
    return acc.add_(1 << (PRECISION_BITS - 1))  # Pillow's sums start at a half unit


def _sums_by_tap(pixels: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                 dim: int) -> torch.Tensor:
    """``resample_axis``'s int32 sums, one filter tap after another."""
    out_size = index.shape[0]
    shape = [out_size if d == dim else n for d, n in enumerate(pixels.shape)]
    acc = torch.full(shape, 1 << (PRECISION_BITS - 1), dtype=torch.int32, device=pixels.device)
    along = [out_size if d == dim else 1 for d in range(len(shape))]
    for tap in range(index.shape[1]):
        acc += pixels.index_select(dim, index[:, tap]).to(torch.int32) * weights[:, tap].view(along)
    return acc


#: The Pillow that the host path runs, (major, minor): the resize follows its order of passes.
PILLOW = tuple(int(part) for part in PIL.__version__.split(".")[:2])


def vertical_first(in_size: tuple[int, int], out_size: tuple[int, int],
                   pillow: tuple[int, ...] = PILLOW) -> bool:
    """Whether Pillow resizes rows (the vertical pass) first, for (width, height) sizes: from
    Pillow 13, when the image loses more than twice as many rows as columns (its
    ImagingResampleInner, checked over random sizes); in 12.2 and 12.3, when it loses rows and
    is over 100 times taller than wide (their Image.resize); before, never."""
    rows_lost = in_size[1] - out_size[1]
    if pillow >= (13, 0):
        return rows_lost > 0 and rows_lost > 2 * (in_size[0] - out_size[0])
    return pillow >= (12, 2) and rows_lost > 0 and in_size[1] > 100 * in_size[0]


def resize(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``Image.resize(size)`` (bicubic) of uint8 pixels (h, w, c): (size[1], size[0], c)."""
    width, height = size
    passes = [(width, 1), (height, 0)]  # (size, dim); a pass whose size holds is skipped
    if vertical_first((int(pixels.shape[1]), int(pixels.shape[0])), size):
        passes.reverse()
    out = pixels
    for out_size, dim in passes:
        if out_size != pixels.shape[dim]:
            out = resample_axis(out, out_size, dim)  # 8-bit between the passes, as Pillow
    return out.clone() if out is pixels else out


def pad(pixels: torch.Tensor, size: tuple[int, int], fill: tuple[int, ...],
        inner: tuple[int, int]) -> torch.Tensor:
    """``ImageOps.pad(image, size, color=fill)`` (bicubic, centred) of uint8 pixels (h, w, c):
    (size[1], size[0], c). ``inner``: its size inside ``size`` (``transform.contained_size``)."""
    if inner == size:
        return resize(pixels, size)
    out = torch.empty(size[1], size[0], len(fill), dtype=torch.uint8, device=pixels.device)
    for channel, value in enumerate(fill):  # scalar fills: nothing copied to the device
        out[..., channel] = value
    if min(inner) == 0:  # ``contain`` gives an empty image: only the fill shows
        return out
    resized = resize(pixels, inner)
    if inner[0] != size[0]:
        left = round((size[0] - inner[0]) * 0.5)
        out[:, left:left + inner[0]] = resized
    else:
        top = round((size[1] - inner[1]) * 0.5)
        out[top:top + inner[1]] = resized
    return out
