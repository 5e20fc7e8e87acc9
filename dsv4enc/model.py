"""DeepSeek-V4 vision tower math (SPEC §2-3, §5): pure torch, no I/O, no distributed calls.

Parameter names are the checkpoint's (``vision.…``, ``aligner.…``). The attention kernel is
injected (``VisionTower.attend``), and tensor parallelism is applied from outside by slicing
weights and setting each module's ``combine`` hook (default: identity), so the same code runs
whole or sharded.

Shapes: T packed tokens (patches), D = dim, H heads of d = D/H, rd = d/2 RoPE angles,
r = downsample ratio, R aligner rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionFn, VarlenSpans, sdpa_attention
from .config import VisionConfig

RMS_EPS = 1e-6


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class RMSNorm(nn.Module):
    """``w * x * rsqrt(mean(x^2) + eps)`` in float32, cast back to the input dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return (self.weight.float() * normed).to(x.dtype)


def rope_tables(positions: torch.Tensor, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE cos/sin for token positions.

    positions: (T, 2) integer (row, col) per token. Returns cos, sin: (T, 1, rd) float32,
    with angles concat(row * inv_freq, col * inv_freq).
    """
    rd = cfg.rope_dim
    exponents = torch.arange(0, rd, 2, dtype=torch.float32, device=positions.device) / rd
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)  # (rd/2,)
    pos = positions.to(torch.float32)
    angles = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:2] * inv_freq], dim=-1)  # (T, rd)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def grid_positions(n_h: int, n_w: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n_h*n_w, 2) int32 (row, col) of each patch in raster order."""
    rows = torch.arange(n_h, dtype=torch.int32, device=device).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.int32, device=device).repeat(n_h)
    return torch.stack([rows, cols], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, d) in float32 with half-split pairs; cos, sin: (T, 1, d/2).

    ``cat(a*cos - b*sin, b*cos + a*sin)``, each half written in place into one output buffer:
    four passes over half-width tensors instead of six products/sums plus a concatenation.
    """
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: VarlenSpans, attend: AttentionFn) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.wqkv(x)  # (T, 3*h*d): q heads, k heads, v heads
        width = qkv.shape[1] // 3
        heads = width // self.head_dim
        # q and k are adjacent columns: rotate them as one (T, 2h, d) tensor (half the ops).
        qk = apply_rope(qkv[:, :2 * width].view(T, 2 * heads, self.head_dim), cos, sin)
        v = qkv[:, 2 * width:].view(T, heads, self.head_dim)
        out = attend(qk[:, :heads], qk[:, heads:], v, spans)
        return self.combine(self.wo(out.reshape(T, -1)))


class MLP(nn.Module):
    """``w2(silu(gate) * up)`` with gate, up = halves of w1(x)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 2 * cfg.inter_dim, bias=False)
        self.w2 = nn.Linear(cfg.inter_dim, cfg.dim, bias=False)
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.combine(self.w2(F.silu(gate).mul_(up)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, spans, attend):
        x = x + self.attn(self.norm1(x), cos, sin, spans, attend)
        return x.add_(self.mlp(self.norm2(x)))  # x is this block's own tensor by now


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

    def forward(self, patches, cos, sin, spans, attend) -> torch.Tensor:
        """patches (T, 3*p*p) -> ViT features (T, D)."""
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
    multiply, so that padding rows holding garbage (inside a CUDA graph) cannot leak NaN.
    """
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

    @property
    def dtype(self) -> torch.dtype:
        return self.vision.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vision.patch_embed.proj.weight.device

    def forward_image(self, patches: torch.Tensor, n_h: int, n_w: int,
                      features: str = "aligner") -> torch.Tensor:
        """One image. patches (n_h*n_w, 3*p*p) -> (rows, width): aligner rows
        (ceil(n_h/r)*ceil(n_w/r), hidden) or ViT features (n_h*n_w, D)."""
        N = n_h * n_w
        cos, sin = rope_tables(grid_positions(n_h, n_w, patches.device), self.cfg)
        spans = VarlenSpans.from_lengths([N], patches.device)
        vit = self.vision(patches, cos, sin, spans, self.attend)
        if features == "vit":
            return vit
        return self.aligner(merge_image(vit, n_h, n_w, self.cfg.downsample_ratio))

    def forward_packed(self, patches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       spans: VarlenSpans, merge_index: torch.Tensor | None,
                       merge_mask: torch.Tensor | None, features: str = "aligner") -> torch.Tensor:
        """Many images in one pass.

        patches (T, 3*p*p); cos, sin (T, 1, rd) float32; spans over T; merge_index and
        merge_mask (R, r*r) into the packed ViT rows. Returns (R, hidden) aligner rows, or
        (T, D) ViT features when ``features == "vit"`` (merge arguments unused).
        """
        vit = self.vision(patches, cos, sin, spans, self.attend)
        if features == "vit":
            return vit
        return self.aligner(merge_gather(vit, merge_index, merge_mask))
