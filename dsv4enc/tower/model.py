"""DeepSeek-V4 vision tower math: pure torch, no I/O, no distributed calls.

Parameter names are the checkpoint's (``vision.…``, ``aligner.…``). The attention kernel is
injected (``VisionTower.attend``), and tensor parallelism is applied from outside by slicing
weights and setting each module's ``combine`` hook (default: identity), so the same code runs
whole or sharded.

Shapes: T packed tokens (patches), D = dim, H heads of d = D/H, rd = d/2 RoPE angles,
r = downsample ratio, R aligner rows."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionFn, VarlenSpans, image_spans, sdpa_attention
from .config import VisionConfig

RMS_EPS = 1e-6


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def by_spans(spans: Sequence[tuple[int, int]], fn: Callable[..., Any],
             *tensors: torch.Tensor) -> Any:
    """``fn`` of each (start, end) row range of ``tensors`` (sliced alike), written into one
    (T, ...) output. A kernel's blocking, vector tails and thread split depend on its input's
    shape: given one image's rows per range, its rows come out the same in any batch."""
    out: torch.Tensor | None = None
    for start, end in spans:
        result = fn(*(t[start:end] for t in tensors))
        if out is None:
            out = result.new_empty((tensors[0].shape[0],) + tuple(result.shape[1:]))
        out[start:end] = result
    if out is None:
        raise ValueError("no rows to run")
    return out


# ---------------------------------------------------------------- elementwise work
# The work between the GEMMs, as plain functions that the modules below call through
# attributes (``norm_fn``, ``rope_fn``, ``act_fn``, ``add_norm_fn``): ``fusion`` installs
# compiled versions there, and this stays the reference math.

def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``w * x * rsqrt(mean(x^2) + eps)`` in float32, cast back to x's dtype. x (T, D)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return (weight.float() * normed).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: returns ``h = x + y`` and ``rms_norm(h)``."""
    h = x + y
    return h, rms_norm(h, weight)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with gate, up = the halves of gate_up (T, 2I) -> (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.norm_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight)


#: RoPE tables grow in blocks of this many positions; each block is computed alone, at a fixed
#: shape, so a position's value never depends on how large the table has grown.
ROPE_BLOCK = 512

_ROPE_CACHE: dict[tuple[float, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_block(first: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (ROPE_BLOCK, rd/2) float32 of positions first.. first+ROPE_BLOCK-1. The angle
    is the float32 ``pos * inv_freq`` (as the reference computes it); numpy takes its cosine
    and sine in float64, rounded once to float32: a fixed function of (position, frequency)."""
    pos = np.arange(first, first + ROPE_BLOCK, dtype=np.float32)[:, None]
    angles = (pos * inv_freq[None, :]).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_table(cfg: VisionConfig, device: torch.device | str,
               positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-axis RoPE cos, sin (P, rd/2) float32 on ``device``, P >= positions a multiple of
    ROPE_BLOCK. Cached per (theta, rope dim, device); call it before a CUDA graph capture with
    the largest position the graph may meet, since a capture cannot grow it."""
    device = torch.device(device)
    key = (float(cfg.rope_theta), cfg.rope_dim, str(device))
    cached = _ROPE_CACHE.get(key)
    if cached is not None and cached[0].shape[0] >= positions:
        return cached
    rd = cfg.rope_dim
    exponents = torch.arange(0, rd, 2, dtype=torch.float32) / rd
    inv_freq = (1.0 / (cfg.rope_theta ** exponents)).numpy()  # (rd/2,) float32
    blocks = [_rope_block(first, inv_freq) for first in range(0, max(positions, 1), ROPE_BLOCK)]
    cos = torch.from_numpy(np.concatenate([c for c, _ in blocks])).to(device)
    sin = torch.from_numpy(np.concatenate([s for _, s in blocks])).to(device)
    _ROPE_CACHE[key] = (cos, sin)
    return cos, sin


def rope_tables(positions: torch.Tensor, cfg: VisionConfig,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE cos, sin (T, 1, rd) float32 of positions (T, 2) integer (row, col): angles
    concat(row * inv_freq, col * inv_freq), gathered from the per-axis tables (``rope_table``),
    so a token's values depend on its position only, never on the batch. ``max_position``: a
    bound on every coordinate, when known (it saves a device sync; a CUDA graph must pass it)."""
    if max_position is None:
        max_position = int(positions.max()) if positions.numel() else 0
    cos_t, sin_t = rope_table(cfg, positions.device, max_position + 1)
    rows, cols = positions[:, 0].long(), positions[:, 1].long()
    cos = torch.cat([cos_t.index_select(0, rows), cos_t.index_select(0, cols)], dim=-1)
    sin = torch.cat([sin_t.index_select(0, rows), sin_t.index_select(0, cols)], dim=-1)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def grid_positions(n_h: int, n_w: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n_h*n_w, 2) int32 (row, col) of each patch in raster order."""
    rows = torch.arange(n_h, dtype=torch.int32, device=device).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.int32, device=device).repeat(n_h)
    return torch.stack([rows, cols], dim=1)


def rope_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` written as the rotation formula (the form a compiler fuses into one pass)."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, d) in float32 with half-split pairs; cos, sin: (T, 1, d/2).

    ``cat(a*cos - b*sin, b*cos + a*sin)``, each half written in place into one output buffer."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    out = torch.empty(xf.shape, dtype=torch.float32, device=xf.device)
    lo, hi = out.chunk(2, dim=-1)
    torch.mul(a, cos, out=lo).addcmul_(b, sin, value=-1.0)
    torch.mul(b, cos, out=hi).addcmul_(a, sin)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention over packed spans. Head count follows wqkv's rows, so a
    tensor-parallel shard (fewer heads) runs the same code."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=True)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=True)
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.rope_fn: Callable[..., torch.Tensor] = apply_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: VarlenSpans, attend: AttentionFn) -> torch.Tensor:
        """x (T, D) -> (T, D): q and k rotated, attended, through wo (summed across TP ranks)."""
        T = x.shape[0]
        qkv = self.wqkv(x)  # (T, 3*h*d): q heads, k heads, v heads
        width = qkv.shape[1] // 3
        heads = width // self.head_dim
        # q and k are adjacent columns: rotate them as one (T, 2h, d) tensor (half the ops).
        qk = self.rope_fn(qkv[:, :2 * width].view(T, 2 * heads, self.head_dim), cos, sin)
        v = qkv[:, 2 * width:].view(T, heads, self.head_dim)
        attended = attend(qk[:, :heads], qk[:, heads:], v, spans)
        return self.combine(self.wo(attended.reshape(T, -1)))


class MLP(nn.Module):
    """``w2(silu(gate) * up)`` with gate, up = halves of w1(x)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 2 * cfg.inter_dim, bias=False)
        self.w2 = nn.Linear(cfg.inter_dim, cfg.dim, bias=False)
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.w2(self.act_fn(self.w1(x))))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.add_norm_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm

    def forward(self, x, cos, sin, spans, attend):
        x, h = self.add_norm_fn(x, self.attn(self.norm1(x), cos, sin, spans, attend),
                                self.norm2.weight)
        return x.add_(self.mlp(h))  # x is this block's own tensor by now


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.to(self.proj.weight.dtype))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)

    def forward(self, patches, cos, sin, spans, attend, per_image: bool = False) -> torch.Tensor:
        """patches (T, 3*p*p) -> ViT features (T, D). ``per_image``: one image's rows at a
        time, so that they are bit-identical in any batch (``by_spans``)."""
        if per_image:
            lengths = spans.lengths
            if lengths is None:
                raise RuntimeError("per-image execution needs host-side span lengths")
            return by_spans(image_spans(lengths), lambda p, c, s: self.forward(
                p, c, s, VarlenSpans.from_lengths([p.shape[0]], p.device), attend),
                patches, cos, sin)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, cos, sin, spans, attend)
        return self.norm(x)


class Aligner(nn.Module):
    """``w2(gelu(w1(row)))`` over merged r x r blocks, exact (erf) GELU."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        r2 = cfg.downsample_ratio ** 2
        self.w1 = nn.Linear(cfg.dim * r2, cfg.hidden_size, bias=True)
        self.w2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.combine(self.w2(F.gelu(self.w1(rows))))


def merge_image(vit: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """Pad-and-unfold merge of one image. vit (n_h*n_w, D) -> (ceil(n_h/r)*ceil(n_w/r), D*r*r),
    feature c*r*r + di*r + dj = channel c of patch (bi*r+di, bj*r+dj)."""
    D = vit.shape[-1]
    hb, wb = -(-n_h // r), -(-n_w // r)
    grid = vit.view(n_h, n_w, D)
    grid = F.pad(grid, (0, 0, 0, wb * r - n_w, 0, hb * r - n_h))
    blocks = grid.view(hb, r, wb, r, D).permute(0, 2, 4, 1, 3)  # (hb, wb, D, r, r)
    return blocks.reshape(hb * wb, D * r * r)


def merge_gather(vit: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Packed merge by gathering. vit (T, D); index, mask: (R, r*r) -> (R, D*r*r).

    Masked positions (past an image's edge) become exact zeros; ``where`` rather than a
    multiply, so that padding rows holding garbage (inside a CUDA graph) cannot leak NaN."""
    R, rr = index.shape
    gathered = vit.index_select(0, index.reshape(-1)).view(R, rr, -1)
    gathered = torch.where(mask.unsqueeze(-1), gathered, torch.zeros((), dtype=vit.dtype,
                                                                      device=vit.device))
    return gathered.transpose(1, 2).reshape(R, -1)


class VisionTower(nn.Module):
    """The ViT plus the aligner. ``attend`` is the attention backend (SDPA per span by default)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg)
        self.aligner = Aligner(cfg)
        self.attend: AttentionFn = sdpa_attention
        #: Compiled elementwise kernels installed (``tower/fusion``): rows equal the eager
        #: tower's to float rounding only, so an output records which made them.
        self.fused = False

    @property
    def dtype(self) -> torch.dtype:
        return self.vision.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vision.patch_embed.proj.weight.device

    @property
    def tensor_parallel(self) -> bool:
        """True once tensor parallelism has installed its all-reduce hooks."""
        return any(getattr(m, "combine", _identity) is not _identity for m in self.modules())

    def forward_image(self, patches: torch.Tensor, n_h: int, n_w: int,
                      features: str = "aligner") -> torch.Tensor:
        """One image. patches (n_h*n_w, 3*p*p) -> (rows, width): aligner rows
        (ceil(n_h/r)*ceil(n_w/r), hidden) or ViT features (n_h*n_w, D)."""
        cos, sin = rope_tables(grid_positions(n_h, n_w, patches.device), self.cfg)
        spans = VarlenSpans.from_lengths([n_h * n_w], patches.device)
        vit = self.vision(patches, cos, sin, spans, self.attend)
        if features == "vit":
            return vit
        return self.aligner(merge_image(vit, n_h, n_w, self.cfg.downsample_ratio))

    def forward_packed(self, patches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       spans: VarlenSpans, merge_index: torch.Tensor | None,
                       merge_mask: torch.Tensor | None, features: str = "aligner",
                       row_counts: Sequence[int] | None = None) -> torch.Tensor:
        """Many images in one pass. patches (T, 3*p*p); cos, sin (T, 1, rd) float32; spans over
        T; merge_index and merge_mask (R, r*r) into the packed ViT rows. Returns (R, hidden)
        aligner rows, or (T, D) ViT features when ``features == "vit"`` (merge unused).
        ``row_counts``: each image's aligner rows; given, every image runs alone (``by_spans``)."""
        per_image = row_counts is not None
        vit = self.vision(patches, cos, sin, spans, self.attend, per_image)
        if features == "vit":
            return vit
        if not per_image:
            return self.aligner(merge_gather(vit, merge_index, merge_mask))
        return by_spans(image_spans(row_counts),
                         lambda index, mask: self.aligner(merge_gather(vit, index, mask)),
                         merge_index, merge_mask)
