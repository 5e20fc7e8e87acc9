"""The one place that builds a tower for running (command line, API, ``bench``): the weights
on a device, split over the ranks (before fusion), fused when asked; and the Engine over it."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import UsageError
from ..tower.checkpoint import Checkpoint, build_tower
from .defaults import DEFAULT_MAX_IMAGES, resolve_fused
from ..tower.model import VisionTower
from .engine import Engine, runs_one_shape

log = logging.getLogger(__name__)


def build_model(ckpt: Checkpoint, device: torch.device | None = None, *,
                fused: bool | None = None, deterministic: bool = True,
                split: Callable[[VisionTower], object] | None = None) -> VisionTower:
    """The tower of ``ckpt`` on ``device``. ``split(model)``: splits its weights over the ranks
    (tensor parallelism) first. ``fused``: compiled elementwise kernels (``tower/fusion``), of
    one shape when an Engine with ``deterministic`` runs every batch at one shape; None: the
    device's default (``defaults.FUSED_BY_DEFAULT``), eager where this torch cannot compile."""
    model = build_tower(ckpt, device) if device is not None else build_tower(ckpt)
    if split is not None:
        split(model)
    if resolve_fused(fused, model.device.type):  # torch.compile's import is slow: only then
        from ..tower.fusion import fuse_elementwise

        try:
            fuse_elementwise(model, dynamic=not runs_one_shape(model, deterministic))
        except UsageError as exc:
            if fused:
                raise
            log.warning("running the eager tower: %s", exc)
    return model


def build_engine(ckpt: Checkpoint, device: torch.device, *, features: str = "aligner",
                 attention: str = "auto", out_dtype: torch.dtype = torch.float32,
                 cuda_graphs: bool | None = None, batch_tokens: int | None = None,
                 max_images: int = DEFAULT_MAX_IMAGES, deterministic: bool = True,
                 fused: bool | None = None,
                 split: Callable[[VisionTower], object] | None = None) -> Engine:
    """``build_model`` and the Engine over it (the arguments as ``Engine``'s)."""
    model = build_model(ckpt, device, fused=fused, deterministic=deterministic, split=split)
    return Engine(model, features=features, attention=attention, out_dtype=out_dtype,
                  cuda_graphs=cuda_graphs, batch_tokens=batch_tokens, max_images=max_images,
                  deterministic=deterministic)
