"""The one place that builds a tower for running (command line, API, ``bench``): the weights
on a device, split over the ranks (before fusion), fused when asked; and the Engine over it."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

import torch

from ..errors import UsageError
from ..tower.checkpoint import Checkpoint, build_tower
from .defaults import resolve_fused
from ..tower.model import VisionTower
from .engine import Engine, runs_one_shape
from .settings import EngineSettings

log = logging.getLogger(__name__)


def build_model(ckpt: Checkpoint, device: torch.device | None = None, *,
                fused: bool | None = None, deterministic: bool = True,
                split: Callable[[VisionTower], object] | None = None) -> VisionTower:
    """The tower of ``ckpt`` on ``device``, first split over the ranks by ``split(model)``.
    ``fused``: compiled elementwise kernels (``tower/fusion``), of one shape when a
    ``deterministic`` Engine runs every batch at one shape; None: the device's default
    (``defaults.FUSED_BY_DEFAULT``), eager where this torch cannot compile."""
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


def build_engine(ckpt: Checkpoint, device: torch.device, settings: EngineSettings | None = None,
                 *, out_dtype: torch.dtype = torch.float32,
                 split: Callable[[VisionTower], object] | None = None, **options: Any) -> Engine:
    """``build_model`` and the Engine over it, as ``settings`` ask (``options``: its fields by
    name, in its place or replacing its values)."""
    settings = replace(settings or EngineSettings(), **options)
    model = build_model(ckpt, device, fused=settings.fused, deterministic=settings.deterministic,
                        split=split)
    return Engine(model, out_dtype=out_dtype, settings=settings)
