"""Many images in one forward, packed on the host (``run/plan`` picks which). A
``PackedBatch`` carries the concatenated patches, the span lengths (for ``cu_seqlens``),
per-token (row, col) positions for RoPE, and the gather plan of each image's merge."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..tower.model import grid_positions
from .defaults import DEFAULT_FEATURES


def aligner_grid(n_h: int, n_w: int, r: int) -> tuple[int, int]:
    """Aligner grid (rows, cols) of an n_h x n_w patch grid: ceil(n_h/r) x ceil(n_w/r)."""
    return -(-n_h // r), -(-n_w // r)


def output_grid(n_h: int, n_w: int, r: int, features: str) -> tuple[int, int]:
    """Grid of the embedding rows: the aligner grid, or the patch grid for ViT features."""
    return aligner_grid(n_h, n_w, r) if features == "aligner" else (n_h, n_w)


def merge_plan(n_h: int, n_w: int, r: int, base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather plan of one image's merge: index (R, r*r) int64 into packed ViT rows (offset by
    ``base``) and mask (R, r*r) bool, False past the image's edge (where the index points at
    the image's first row, a real row, and the mask zeroes it)."""
    index, mask = _merge_plan_at_zero(n_h, n_w, r)
    return index + base, mask.clone()


@functools.lru_cache(maxsize=256)
def _merge_plan_at_zero(n_h: int, n_w: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_plan`` at base 0, made once per grid (a run has few: one camera's photos share
    one). Callers never see these tensors, only new ones made of them."""
    hb, wb = aligner_grid(n_h, n_w, r)
    bi = torch.arange(hb).repeat_interleave(wb).view(-1, 1)  # (R, 1)
    bj = torch.arange(wb).repeat(hb).view(-1, 1)
    di = torch.arange(r).repeat_interleave(r).view(1, -1)  # (1, r*r)
    dj = torch.arange(r).repeat(r).view(1, -1)
    row, col = bi * r + di, bj * r + dj
    mask = (row < n_h) & (col < n_w)
    index = torch.where(mask, row * n_w + col, torch.zeros((), dtype=torch.int64))
    return index, mask


@dataclass
class PackedBatch:
    """A batch of images packed along the token axis (host tensors until ``.to``)."""

    patches: torch.Tensor  # (T, 3*p*p) bfloat16
    positions: torch.Tensor  # (T, 2) int32 (row, col)
    lengths: list[int]  # tokens per image
    grids: list[tuple[int, int]]  # (n_h, n_w) per image
    merge_index: torch.Tensor  # (R, r*r) int64
    merge_mask: torch.Tensor  # (R, r*r) bool
    row_counts: list[int] = field(default_factory=list)  # output rows per image

    @property
    def n_tokens(self) -> int:
        return int(self.patches.shape[0])

    @property
    def n_rows(self) -> int:
        return sum(self.row_counts)

    def split_rows(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Cut (sum rows, width) output back into one tensor per image."""
        return list(torch.split(out, self.row_counts, dim=0))


@functools.lru_cache(maxsize=256)
def _grid_positions(n_h: int, n_w: int) -> torch.Tensor:
    """``model.grid_positions`` on the CPU, made once per grid (only ever copied from)."""
    return grid_positions(n_h, n_w)


#: Where a batch's patches go: ``(tokens, width, dtype) -> empty tensor`` (``Engine.patch_buffer``).
PatchBuffer = Callable[[int, int, torch.dtype], torch.Tensor]


def concat_patches(patches: Sequence[torch.Tensor], buffer: PatchBuffer | None = None,
                   ) -> torch.Tensor:
    """The images' patches one after another, in ``buffer(tokens, width, dtype)`` when given
    (the engine's staging memory) or a new tensor; if any were made on a device, joined there.
    Copied by numpy on the calling thread: ``torch.cat`` would split large copies over torch's
    intra-op threads, which then spin and take CPU from the decode workers."""
    width, dtype = (patches[0].shape[1], patches[0].dtype) if patches else (0, torch.bfloat16)
    device = next((t.device for t in patches if t.device.type != "cpu"), None)
    if device is not None:  # made on the device (``Engine.transform``): joined there
        return torch.cat([t.to(device) for t in patches])
    tokens = sum(int(t.shape[0]) for t in patches)
    out = (buffer(tokens, width, dtype) if buffer is not None
           else torch.empty(tokens, width, dtype=dtype))
    if any(t.dtype != out.dtype or t.device.type != "cpu" for t in patches):
        return torch.cat(list(patches), out=out)
    flat = out.view(torch.int16).numpy() if out.element_size() == 2 else out.numpy()
    start = 0
    for t in patches:
        end = start + int(t.shape[0])
        flat[start:end] = t.view(torch.int16).numpy() if t.element_size() == 2 else t.numpy()
        start = end
    return out


def pack(items: Sequence[tuple[torch.Tensor, int, int]], r: int,
         features: str = DEFAULT_FEATURES,
         patch_buffer: PatchBuffer | None = None) -> PackedBatch:
    """Pack ``(patches (n_h*n_w, 3*p*p), n_h, n_w)`` items into one PackedBatch, the patches
    into ``patch_buffer`` when given (``concat_patches``)."""
    lengths = [n_h * n_w for _, n_h, n_w in items]
    grids = [(n_h, n_w) for _, n_h, n_w in items]
    plans = [_merge_plan_at_zero(h, w, r) for h, w in grids] if features == "aligner" else []
    starts = itertools.accumulate(lengths, initial=0)
    indices = [index + base for (index, _), base in zip(plans, starts)]
    masks = [mask for _, mask in plans]  # torch.cat below copies them
    row_counts = [len(index) for index, _ in plans] if features == "aligner" else list(lengths)
    rr = r * r
    return PackedBatch(
        patches=concat_patches([p for p, _, _ in items], patch_buffer),
        positions=torch.cat([_grid_positions(n_h, n_w) for _, n_h, n_w in items]),
        lengths=lengths,
        grids=grids,
        merge_index=torch.cat(indices) if indices else torch.zeros(0, rr, dtype=torch.int64),
        merge_mask=torch.cat(masks) if masks else torch.zeros(0, rr, dtype=torch.bool),
        row_counts=row_counts,
    )
