"""Fused elementwise work around the GEMMs (``--fused``): torch.compile of the model's own
functions, installed from outside so that ``model.py`` stays the eager reference.

Fused: float32 RMSNorm (with the residual add before the second norm), RoPE on q and k, and
SwiGLU. GEMMs and attention stay as they are (cuBLAS / MKL / oneDNN and the attention
backend), so the fused tower computes the same math with fewer passes over memory: on CUDA
each of these becomes one Triton kernel instead of five to eight ATen ones; on the CPU one
inductor C++ loop.

Compiled with ``dynamic=True``: one kernel serves every row count, so the CPU's per-image
execution and the CUDA buckets do not recompile per shape, and a row's value depends on its
own data only (rows stay batch-invariant). Results equal the eager functions to float
rounding (a fused kernel may keep a value in a register in float32 instead of rounding it to
the compute dtype in between): ``tests/test_fusion.py`` holds them to it.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .errors import UsageError
from .model import VisionTower, add_rms_norm, rms_norm, rope_formula, swiglu

log = logging.getLogger(__name__)


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled by inductor for any row count (no graph breaks allowed)."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def fuse_elementwise(model: VisionTower) -> VisionTower:
    """Install compiled elementwise functions on every block of ``model`` (in place).

    The compile itself happens at the first forward (and takes tens of seconds on a CPU).
    Raises UsageError when this torch cannot compile (no inductor, no C++ compiler found).
    """
    try:
        import torch._inductor  # noqa: F401  (the backend torch.compile uses)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        raise UsageError(f"--fused needs torch.compile's inductor backend ({exc})") from None
    norm, add_norm, rope, act = (compiled(f) for f in (rms_norm, add_rms_norm, rope_formula,
                                                       swiglu))
    model.vision.norm.norm_fn = norm
    for block in model.vision.blocks:
        block.norm1.norm_fn = norm
        block.norm2.norm_fn = norm
        block.add_norm_fn = add_norm
        block.attn.rope_fn = rope
        block.mlp.act_fn = act
    log.info("fused elementwise kernels installed (compiled at the first batch)")
    return model
