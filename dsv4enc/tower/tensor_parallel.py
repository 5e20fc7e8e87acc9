"""Tensor parallelism as a model transform: a tower sliced in place into one rank's shard, with
combine hooks that sum the partial outputs over the ranks (``run/ranks.Topology.split_tower``
applies it with the rank, the world size and its process group's all-reduce)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .model import VisionTower

log = logging.getLogger(__name__)

#: Sums a tensor over the ranks in place and returns it.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _shard_rows(linear: torch.nn.Linear, groups: int, rank: int, world: int) -> None:
    """Keep this rank's share of each of ``groups`` equal output row blocks (q|k|v by heads,
    gate|up by halves): weight (G*n, in) -> (G*n/world, in)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        blocks = t.view(groups, world, -1, *t.shape[1:])  # (G, world, n/world, ...)
        return blocks[:, rank].reshape(-1, *t.shape[1:]).clone()
    linear.weight = torch.nn.Parameter(cut(linear.weight.data), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(cut(linear.bias.data), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _shard_columns(linear: torch.nn.Linear, rank: int, world: int,
                   all_reduce: AllReduce) -> Callable[[torch.Tensor], torch.Tensor]:
    """Keep this rank's block of input columns; the combine hook that sums the partial
    outputs. The bias moves out of the matmul: it is added once, after the sum."""
    share = linear.in_features // world
    cols = slice(rank * share, (rank + 1) * share)
    linear.weight = torch.nn.Parameter(linear.weight.data[:, cols].clone(), requires_grad=False)
    linear.in_features = share
    bias = None if linear.bias is None else linear.bias.data
    linear.bias = None
    # A non-persistent buffer (None when there is no bias): ``model.to(...)`` moves it along.
    linear.register_buffer("combine_bias", bias, persistent=False)

    def combine(partial: torch.Tensor) -> torch.Tensor:
        total = all_reduce(partial.contiguous())
        return total if linear.combine_bias is None else total + linear.combine_bias

    return combine


def apply_tensor_parallel(model: VisionTower, rank: int, world_size: int,
                          all_reduce: AllReduce) -> bool:
    """Slice ``model`` in place into rank ``rank``'s tensor-parallel shard of ``world_size``
    (``all_reduce``: ``run/dist.DistContext.all_reduce_sum``).

    wqkv (by heads), mlp.w1 (gate, up by halves) and aligner.w1 keep their share of output
    rows; wo, mlp.w2 and aligner.w2 their share of input columns, with an all-reduce
    ``combine`` hook that adds the bias after the sum. Patch embed and norms stay whole, so
    activations between blocks are identical on every rank. Returns False, model untouched,
    when the world size is 1 or does not divide the heads, MLP and aligner widths."""
    cfg, world = model.cfg, world_size
    if world == 1:
        return False
    sizes = {"heads": cfg.n_heads, "MLP width": cfg.inter_dim, "aligner width": cfg.hidden_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % world]
    if bad:
        log.warning("tensor parallel needs the world size %d to divide %s; replicating the "
                    "tower on every rank (data parallel) instead", world, ", ".join(bad))
        return False
    for block in model.vision.blocks:
        _shard_rows(block.attn.wqkv, 3, rank, world)
        block.attn.combine = _shard_columns(block.attn.wo, rank, world, all_reduce)
        _shard_rows(block.mlp.w1, 2, rank, world)
        block.mlp.combine = _shard_columns(block.mlp.w2, rank, world, all_reduce)
    _shard_rows(model.aligner.w1, 1, rank, world)
    model.aligner.combine = _shard_columns(model.aligner.w2, rank, world, all_reduce)
    return True
