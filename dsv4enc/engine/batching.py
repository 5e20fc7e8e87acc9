"""The batch loop of the command line, the Python API and the benchmark: tagged images packed,
run with one batch queued on the device while the caller prepares the next, and their outputs
checked for inf and NaN (never returned)."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .engine import Engine, NonFiniteOutput
from .packing import PackedBatch, pack

#: One image for ``BatchLoop.submit``: (patches, n_h, n_w), as ``packing.pack`` takes it.
Image = tuple[torch.Tensor, int, int]


class BatchLoop:
    """Packs, submits and collects batches on ``engine``, one batch in flight ahead.

    ``pool``: ``"mean"`` returns one vector per image, ``"none"`` every row. ``name_of(tag)``
    names an image in the error for a non-finite output, then ``remedy``. ``copy``: outputs
    always own their memory (the API hands them to users); otherwise only page-locked ones
    are copied, the others stay views of their batch's output (the command line drops them)."""

    def __init__(self, engine: Engine, pool: str = "none", *,
                 name_of: Callable[[Any], Any] = str, remedy: str = "",
                 copy: bool = True) -> None:
        self.engine, self.pool, self.copy = engine, pool, copy
        self.name_of, self.remedy = name_of, remedy
        self._tags: deque[list[Any]] = deque()  # per batch in flight, its images' tags
        while engine.pending:  # left by an earlier loop that was abandoned mid-batch
            engine.collect()

    def submit(self, tags: Sequence[Any], images: Sequence[Image]) -> PackedBatch:
        """Pack ``images`` into one batch and start it; returns the packed batch."""
        packed = pack(list(images), self.engine.cfg.downsample_ratio, self.engine.features,
                      getattr(self.engine, "patch_buffer", None))
        self.submit_packed(tags, packed)
        return packed

    def submit_packed(self, tags: Sequence[Any], packed: PackedBatch) -> None:
        """Start a batch packed beforehand (the benchmark packs outside its timed region)."""
        self.engine.submit(packed)
        self._tags.append(list(tags))

    def collect_ready(self) -> list[tuple[Any, torch.Tensor]]:
        """The oldest batch's outputs once a newer one is queued behind it, else nothing."""
        return self.collect() if len(self._tags) > 1 else []

    def collect(self) -> list[tuple[Any, torch.Tensor]]:
        """``(tag, output)`` of the oldest batch in flight, in order (waits for the device).
        ``NonFiniteOutput`` (its ``tag`` set) for the first non-finite output, scanned for only
        when the engine's one reduction per batch found one."""
        tags = self._tags.popleft()
        outputs = self.engine.collect()
        if not self.engine.last_finite:
            dtype = str(self.engine.out_dtype).removeprefix("torch.")
            # float32 holds any finite output, and a cast overflows to inf, never NaN: the
            # tower's own output is not finite then
            tower_s = "the tower itself computes it so: check the weights"
            for position, out in enumerate(outputs):
                if not torch.isfinite(out).all():
                    remedy = (self.remedy if self.engine.out_dtype != torch.float32
                              and not out.isnan().any() else tower_s)
                    exc = NonFiniteOutput(position, f"embedding of {self.name_of(tags[position])}"
                                                    f" is not finite in {dtype}; {remedy}")
                    exc.tag = tags[position]
                    raise exc
        return [(tag, self.finish(out)) for tag, out in zip(tags, outputs)]

    def drain(self) -> list[tuple[Any, torch.Tensor]]:
        """Collect every batch still in flight."""
        done: list[tuple[Any, torch.Tensor]] = []
        while self._tags:
            done.extend(self.collect())
        return done

    def run(self, batches: Iterable[tuple[Sequence[Any], Sequence[Image]]],
            ) -> Iterator[list[tuple[Any, torch.Tensor]]]:
        """Encode ``(tags, images)`` batches, one in flight ahead; yields ``collect``'s lists."""
        for tags, images in batches:
            self.submit(tags, images)
            if len(self._tags) > 1:
                yield self.collect()
        while self._tags:
            yield self.collect()

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """One image's output as returned: pooled, and owning its memory where needed."""
        if self.pool == "mean":  # in float32 whatever the output dtype, then cast back
            return out.float().mean(0).to(out.dtype)
        if self.copy or out.is_pinned():
            # Page-locked memory goes back to the allocator's cache instead of living as a row.
            return out.clone()
        return out
