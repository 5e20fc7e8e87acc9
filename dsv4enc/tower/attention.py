"""Attention backends behind one signature, chosen once per run.

Every backend computes full bidirectional softmax attention restricted to each image's span
of a packed batch::

    attend(q, k, v, spans) -> out      # q, k, v, out: (T, H, d); spans: VarlenSpans

- ``flash``: ``flash_attn_varlen_func`` (the optional ``gpu`` extra).
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on CUDA, where this torch has it.
- ``sdpa``: ``scaled_dot_product_attention`` per span, each a contiguous (1, H, N, d) tensor:
  the layout PyTorch's fused CPU kernel takes (3-D inputs take the unfused math path).
- ``grouped``: the spans of each length as one batched SDPA over a (B, H, N, d) tensor, so
  that many photos on the same canvas take one large kernel instead of B small ones; a span
  with a length of its own runs alone, as in ``sdpa``. An image gets the same kernel at the
  same N whatever shares its batch (B only counts the kernel's independent (image, head)
  problems), which keeps rows batch-invariant; a varlen kernel for the rest would not.

``flash`` and ``varlen`` read only device tensors, so they can run inside a CUDA graph;
``sdpa`` and ``grouped`` need the host-side span lengths."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import UsageError
from .config import ATTENTION_BACKENDS


@dataclass
class VarlenSpans:
    """Where each image's tokens lie in a packed batch."""

    cu_seqlens: torch.Tensor  # (B+1,) int32 on the compute device, cumulative token offsets
    max_seqlen: int  # an upper bound on any span's length
    lengths: Sequence[int] | None = None  # on the host; None inside a CUDA graph

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str) -> "VarlenSpans":
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        if lengths:
            cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
        return cls(cu.to(device), max(lengths, default=0), tuple(int(n) for n in lengths))


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenSpans], torch.Tensor]


def image_spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) row range of each image packed back to back; empty images are left out."""
    starts = itertools.accumulate(lengths, initial=0)
    return [(start, start + n) for start, n in zip(starts, lengths) if n]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   spans: VarlenSpans) -> torch.Tensor:
    """Per-span SDPA. q, k, v: (T, H, d) -> (T, H, d). Tokens outside every span get zeros."""
    if spans.lengths is None:
        raise RuntimeError("sdpa attention needs host-side span lengths")
    out = torch.zeros_like(q) if sum(spans.lengths) < q.shape[0] else torch.empty_like(q)
    for start, end in image_spans(spans.lengths):
        # (N, H, d) -> (1, H, N, d), contiguous: the layout the fused CPU kernel takes.
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[start:end] = o[0].transpose(0, 1)
    return out


def length_groups(lengths: Sequence[int]) -> dict[int, list[int]]:
    """The start of every non-empty span, grouped by length (in order of first appearance)."""
    groups: dict[int, list[int]] = {}
    for start, end in image_spans(lengths):
        groups.setdefault(end - start, []).append(start)
    return groups


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      spans: VarlenSpans) -> torch.Tensor:
    """One batched SDPA per span length. q, k, v: (T, H, d) -> (T, H, d). Tokens outside
    every span get zeros."""
    if spans.lengths is None:
        raise RuntimeError("grouped attention needs host-side span lengths")
    out = torch.zeros_like(q) if sum(spans.lengths) < q.shape[0] else torch.empty_like(q)
    for n, starts in length_groups(spans.lengths).items():
        # (B, H, N, d), contiguous: one copy per tensor, the layout of sdpa's per-span calls.
        qs, ks, vs = (torch.stack([t[s:s + n].transpose(0, 1) for s in starts]) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)  # (B, N, H, d)
        for i, s in enumerate(starts):
            out[s:s + n] = o[i]
    return out


def naive_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         spans: VarlenSpans) -> torch.Tensor:
    """Per-span SDPA on 3-D (H, N, d) views, as a first port of the reference would: the
    benchmarks' naive baseline (PyTorch's unfused math path on the CPU)."""
    assert spans.lengths is not None
    out = torch.zeros_like(q)
    for start, end in image_spans(spans.lengths):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1),
                                           k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1))
        out[start:end] = o.transpose(0, 1)
    return out


def _torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_call(kernel: Callable, **options) -> AttentionFn:
    """A varlen kernel (cu_seqlens and max_seqlen for q and k) in the common signature (its
    default scale is d^-0.5, ours)."""
    def attend(q, k, v, spans):
        cu = spans.cu_seqlens
        return kernel(q, k, v, cu, cu, spans.max_seqlen, spans.max_seqlen, **options)

    return attend


def varlen_attention_fn() -> AttentionFn:
    """``torch.nn.attention.varlen.varlen_attn`` wrapped to the common signature."""
    varlen_attn = _torch_varlen()
    if varlen_attn is None:
        raise UsageError("attention 'varlen' needs torch.nn.attention.varlen "
                         f"(not in torch {torch.__version__})")
    return _varlen_call(varlen_attn)  # its default mask is none (not causal)


def flash_attention_fn() -> AttentionFn:
    """flash-attn's ``flash_attn_varlen_func`` wrapped to the common signature."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        raise UsageError("attention 'flash' needs the flash-attn package "
                         "(pip install 'dsv4enc[gpu]')") from None
    return _varlen_call(flash_attn_varlen_func, causal=False)


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on ``device``, fastest first."""
    names = []
    if device.type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash")
        if _torch_varlen() is not None:
            names.append("varlen")
    names.append("sdpa")
    return names


def select_attention(name: str, device: torch.device | str) -> tuple[str, AttentionFn]:
    """The backend: ``auto`` picks the fastest that runs on ``device``; a forced backend that
    cannot run here is a UsageError."""
    device = torch.device(device)
    if name not in ATTENTION_BACKENDS:
        raise UsageError(f"unknown attention backend {name!r} (choose from "
                         f"{', '.join(ATTENTION_BACKENDS)})")
    if name == "auto":
        name = available_backends(device)[0]
    if name in ("flash", "varlen") and device.type != "cuda":
        raise UsageError(f"attention {name!r} needs a CUDA device, not {device}")
    makers = {"flash": flash_attention_fn, "varlen": varlen_attention_fn}
    host_side = {"sdpa": sdpa_attention, "grouped": grouped_attention}
    return name, makers[name]() if name in makers else host_side[name]
