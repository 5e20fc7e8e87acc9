"""Runs packed batches through the tower on one device: attention backend chosen once,
transfers, and (on CUDA) graph replay. Host in, host out.

This is the only place that moves batches between host and device; the pipeline hands it
``PackedBatch`` objects and gets per-image embeddings back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import VarlenSpans, select_attention
from .model import VisionTower, rope_tables
from .packing import PackedBatch


@dataclass
class EngineStats:
    """Seconds spent per stage and work done, for the summary and benchmarks."""

    h2d_s: float = 0.0
    model_s: float = 0.0
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0  # tokens computed beyond the real ones (graph budgets)


class Engine:
    """Encodes PackedBatches with a VisionTower.

    ``features``: "aligner" or "vit". ``out_dtype``: dtype of the returned rows.
    """

    def __init__(self, model: VisionTower, features: str = "aligner",
                 attention: str = "auto", out_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.device = model.device
        self.features = features
        self.out_dtype = out_dtype
        self.attention_name, model.attend = select_attention(attention, self.device)
        self.stats = EngineStats()

    @property
    def cfg(self):
        return self.model.cfg

    def to_device(self, batch: PackedBatch) -> dict:
        """Device tensors of a batch: patches, RoPE tables, spans, merge plan."""
        dev = self.device
        non_blocking = dev.type == "cuda"
        positions = batch.positions.to(dev, non_blocking=non_blocking)
        cos, sin = rope_tables(positions, self.cfg)
        return {
            "patches": batch.patches.to(dev, non_blocking=non_blocking),
            "cos": cos,
            "sin": sin,
            "spans": VarlenSpans.from_lengths(batch.lengths, dev),
            "merge_index": batch.merge_index.to(dev, non_blocking=non_blocking),
            "merge_mask": batch.merge_mask.to(dev, non_blocking=non_blocking),
        }

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Eager packed forward on the device. Returns (R, width) in the compute dtype."""
        inputs = self.to_device(batch)
        return self.model.forward_packed(features=self.features, **inputs)

    def encode(self, batch: PackedBatch) -> list[torch.Tensor]:
        """Encode one packed batch; one host tensor (rows, width) per image, in out_dtype."""
        out = self.forward(batch).to(self.out_dtype)
        out = out.cpu() if out.device.type != "cpu" else out
        self.stats.batches += 1
        self.stats.real_tokens += batch.n_tokens
        return batch.split_rows(out)

