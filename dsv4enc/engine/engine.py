"""Runs packed batches through the tower on one device, host in, host out. On CUDA a batch
goes: pinned host copy -> H2D on a copy stream -> (graph buffers ->) forward on the compute
stream -> cast -> D2H into pinned memory on a third stream. ``submit`` only enqueues that
work, so batch k+1's staging and H2D overlap batch k's compute (``Engine.encode_many``)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..tower.attention import VarlenSpans, select_attention
from ..errors import DsvError, UsageError
from .graphs import GRAPH_BACKENDS, BucketRunner, default_budgets, fit_budgets
from ..tower.model import VisionTower, rope_tables
from .settings import EngineSettings
from .packing import PackedBatch
from ..tower.transform import max_image_tokens, pixels_to_patches

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Seconds spent per stage and work done, for the summary and benchmarks: on CUDA the
    stage times are CUDA-event intervals on their own streams (they overlap), else wall time."""

    h2d_s: float = 0.0
    model_s: float = 0.0
    d2h_s: float = 0.0
    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0  # tokens computed beyond the real ones (graph budgets)
    graph_batches: int = 0  # batches replayed from a captured graph
    variant_batches: int = 0  # batches run outside the batch-invariant path (see Engine)


@dataclass
class _Pending:
    """One submitted batch: its host output buffer and the events that time it."""

    batch: PackedBatch
    out: torch.Tensor  # (rows, width) out_dtype, host (pinned on CUDA)
    padded: int = 0
    graph: bool = False  # replayed from a captured graph
    events: dict[str, torch.cuda.Event] = field(default_factory=dict)
    seconds: float = 0.0  # CPU: model wall time
    finite: torch.Tensor | None = None  # () bool, host: every output value is finite


def resolve_attention(name: str, device: torch.device, dtype: torch.dtype):
    """The attention backend (name, function) for ``device`` and compute ``dtype``: in float32
    ``auto`` is SDPA and a forced ``flash`` or ``varlen`` (fp16/bf16 kernels) a UsageError."""
    if device.type == "cuda" and dtype == torch.float32:
        if name == "auto":
            name = "sdpa"
        elif name in GRAPH_BACKENDS:
            raise UsageError(f"attention {name!r} needs bfloat16 or float16, not float32")
    return select_attention(name, device)


def runs_one_shape(model: VisionTower, deterministic: bool) -> bool:
    """Whether an Engine over ``model`` runs every batch at one shape: the batch-invariant path
    on CUDA (one bucket for any single image), off under tensor parallelism (see Engine)."""
    return deterministic and not model.tensor_parallel and model.device.type == "cuda"


class Engine:
    """Encodes PackedBatches with a VisionTower.

    ``settings``: an ``EngineSettings``; ``features``, ``attention`` and ``options`` (its fields
    by name) replace its values where not None. ``cuda_graphs``: None = on when the device is
    CUDA and the attention backend can be captured (flash, varlen); True on a CPU device is a
    UsageError; with SDPA it falls back to eager with a log line. ``batch_tokens`` /
    ``max_images``: the largest batch the caller will submit. ``min_budget``: the smallest
    graph token budget (``graphs.default_budgets``). ``deterministic``: an image's output bytes
    do not depend on its batch (on the CPU each image runs through the tower alone; on CUDA
    every batch in one fixed-shape bucket), except under tensor parallelism, whose
    all-reduces sum in another order."""

    def __init__(self, model: VisionTower, features: str | None = None,
                 attention: str | None = None, out_dtype: torch.dtype = torch.float32, *,
                 settings: EngineSettings | None = None, min_budget: int = 1024,
                 **options: Any) -> None:
        given = dict(features=features, attention=attention, **options)
        settings = replace(settings or EngineSettings(),
                           **{name: value for name, value in given.items() if value is not None})
        self.settings = settings = settings.for_device(model.device.type)
        self.model = model
        self.device = model.device
        self.features = settings.features
        self.out_dtype = out_dtype
        self.attention_name, self._attend = resolve_attention(settings.attention, self.device,
                                                              model.dtype)
        model.attend = self._attend
        self.batch_tokens: int = settings.batch_tokens
        self.max_images = settings.max_images
        self.stats = EngineStats()
        self.last_finite = True  # every value of the last collected batch was finite
        self._pending: deque[_Pending] = deque()
        self.runner: BucketRunner | None = None
        self.deterministic = settings.deterministic and not model.tensor_parallel
        self.fused = model.fused  # compiled elementwise kernels (after any eager fallback)
        graphs = self._want_graphs(settings.cuda_graphs)
        if runs_one_shape(model, settings.deterministic):
            # One bucket that holds any single image: every batch runs at the same shapes.
            top = max(self.batch_tokens, max_image_tokens(model.cfg))
            self.runner = self._bucket_runner([top], capture=graphs)
        elif graphs:
            self.runner = self._bucket_runner(default_budgets(self.batch_tokens, min_budget))
        if self.device.type == "cuda":
            self._h2d_stream = torch.cuda.Stream(self.device)
            self._d2h_stream = torch.cuda.Stream(self.device)
            self._transform_stream = torch.cuda.Stream(self.device)

    def _want_graphs(self, cuda_graphs: bool | None) -> bool:
        if cuda_graphs and self.device.type != "cuda":
            raise UsageError(f"CUDA graphs need a CUDA device, not {self.device}")
        if cuda_graphs is False or self.device.type != "cuda":
            return False
        if self.attention_name not in GRAPH_BACKENDS:
            # Asked for explicitly: say so louder than when it is just the default.
            log.log(logging.WARNING if cuda_graphs else logging.INFO,
                    "CUDA graphs off: attention %r needs host-side lengths; running eagerly",
                    self.attention_name)
            return False
        return True

    def _bucket_runner(self, budgets: Sequence[int], capture: bool = True) -> BucketRunner:
        return BucketRunner(self.model, self.features, budgets, self.max_images,
                            max_seqlen=max_image_tokens(self.model.cfg), capture=capture)

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def graphs_enabled(self) -> bool:
        """True once graphs are (or will be) replayed: capture may still fall back."""
        return self.runner is not None and self.runner.capture

    @property
    def pending(self) -> int:
        """Batches submitted and not yet collected."""
        return len(self._pending)

    def patch_buffer(self, tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for ``packing.pack`` to fill: page-locked on CUDA (copied once)."""
        return torch.empty(tokens, width, dtype=dtype, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def transform(self, pixels: np.ndarray) -> torch.Tensor:
        """One image's bf16 patches (n_h*n_w, 3*p*p), the host path's bytes, made on this
        device from its pixels (uint8 (h, w, c), ``transform.image_pixels``). On CUDA on a side
        stream (beside the batch in flight), which the current stream then waits for."""
        host = torch.from_numpy(pixels)
        if self.device.type != "cuda":
            return pixels_to_patches(host, self.cfg)[0]
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._transform_stream):
            # Page-locked first: the copy is then asynchronous, and the caller's pixels (a
            # decode worker's shared slot) are free again at once.
            patches = pixels_to_patches(host.pin_memory().to(self.device, non_blocking=True),
                                        self.cfg)[0]
        current.wait_stream(self._transform_stream)
        patches.record_stream(current)  # made on the side stream, used on the current one
        return patches

    def _use_backend(self) -> None:
        """Put this engine's backend back before a forward: engines may share a model."""
        self.model.attend = self._attend

    def fit_budgets(self, bin_tokens: Sequence[int], max_budgets: int = 6) -> None:
        """Graph budgets that pad ``bin_tokens`` least (``graphs.fit_budgets``), instead of
        powers of two, when every batch's size is known before capture. No-op once captured."""
        if self.graphs_enabled and bin_tokens and not (self.runner.graphs or self.deterministic):
            self.runner = self._bucket_runner(fit_budgets(bin_tokens, max_budgets))

    def prepare(self) -> None:
        """Capture the CUDA graphs now (else it happens at the first submit)."""
        if self.graphs_enabled and not self.runner.graphs:
            self._use_backend()
            with torch.cuda.device(self.device):
                self.runner.capture_all()

    def _eager(self, batch: PackedBatch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """``batch``'s forward over its unpadded ``dev`` tensors (by image: CPU deterministic)."""
        cos, sin = rope_tables(dev["positions"], self.cfg,
                               max((max(g) for g in batch.grids), default=0))
        spans = VarlenSpans(dev["cu_seqlens"], max(batch.lengths, default=0), tuple(batch.lengths))
        by_image = self.deterministic and self.device.type != "cuda"
        return self.model.forward_packed(dev["patches"], cos, sin, spans, dev.get("merge_index"),
                                         dev.get("merge_mask"), features=self.features,
                                         row_counts=batch.row_counts if by_image else None)

    def encode(self, batch: PackedBatch) -> list[torch.Tensor]:
        """Encode one packed batch; one host tensor (rows, width) per image, in out_dtype."""
        if self._pending:
            raise RuntimeError("encode() with batches still pending; collect() them first")
        self.submit(batch)
        return self.collect()

    def encode_many(self, batches: Iterable[PackedBatch]) -> Iterator[list[torch.Tensor]]:
        """Each batch's per-image outputs, in order, one batch in flight ahead."""
        for batch in batches:
            self.submit(batch)
            if len(self._pending) > 1:
                yield self.collect()
        while self._pending:
            yield self.collect()

    def submit(self, batch: PackedBatch) -> None:
        """Start encoding ``batch``; its result comes from a later ``collect``, in order."""
        if self.device.type != "cuda":
            began = time.perf_counter()
            self._use_backend()
            with torch.inference_mode():
                out = self._eager(batch, self._host_inputs(batch)).to(self.out_dtype)
            self._pending.append(_Pending(batch, out, seconds=time.perf_counter() - began,
                                          finite=torch.isfinite(out).all()))
            return
        with torch.cuda.device(self.device):
            self.prepare()
            self._pending.append(self._submit_cuda(batch))

    def collect(self) -> list[torch.Tensor]:
        """Wait for the oldest submitted batch; its per-image host tensors (rows, width)."""
        job = self._pending.popleft()
        s, ev = self.stats, job.events
        if ev:
            ev["done"].synchronize()
            s.h2d_s += ev["h2d0"].elapsed_time(ev["h2d1"]) / 1e3
            s.model_s += ev["m0"].elapsed_time(ev["m1"]) / 1e3
            s.d2h_s += ev["m1"].elapsed_time(ev["done"]) / 1e3
        else:
            s.model_s += job.seconds
        s.batches += 1
        s.real_tokens += job.batch.n_tokens
        s.padded_tokens += job.padded
        s.graph_batches += job.graph
        self.last_finite = job.finite is None or bool(job.finite)
        return job.batch.split_rows(job.out)

    def _host_inputs(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """The eager path's host tensors to transfer, exact (not padded to a bucket)."""
        host = {"patches": batch.patches, "positions": batch.positions,
                "cu_seqlens": VarlenSpans.from_lengths(batch.lengths, "cpu").cu_seqlens}
        if self.features == "aligner":
            host["merge_index"], host["merge_mask"] = batch.merge_index, batch.merge_mask
        return host

    def _submit_cuda(self, batch: PackedBatch) -> _Pending:
        self._use_backend()
        runner = self.runner
        bucket = runner.choose(batch) if runner is not None else None
        if runner is not None and bucket is None:
            log.log(logging.WARNING if self.deterministic else logging.DEBUG,
                    "batch of %d tokens, %d images fits no bucket: eager%s", batch.n_tokens,
                    len(batch.lengths), " (its rows are not batch-invariant)"
                    if self.deterministic else "")
        staged = runner.stage(batch, bucket) if bucket is not None else None
        host = staged.tensors() if staged is not None else self._host_inputs(batch)
        # Pinned copies (the caching host allocator keeps each block until its copy is done).
        # (Patches made on the device by ``transform`` are there already.)
        pinned = {k: v if v.is_cuda else v.pin_memory() for k, v in host.items()}
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("h2d0", "h2d1", "m0", "m1", "done")}
        compute = torch.cuda.current_stream(self.device)
        # Allocate the device copies on the copy stream (their first writer), and mark them
        # used by the compute stream: the allocator then cannot hand their memory to a later
        # copy while this batch's forward still reads it.
        with torch.cuda.stream(self._h2d_stream):
            ev["h2d0"].record()
            dev = {k: v.to(self.device, non_blocking=True) for k, v in pinned.items()}
            ev["h2d1"].record()
        compute.wait_event(ev["h2d1"])
        for t in dev.values():
            t.record_stream(compute)
        ev["m0"].record(compute)
        with torch.inference_mode():
            if bucket is not None:
                runner.load(replace(staged, **dev))
                out = runner.run(bucket, staged.lengths)[:batch.n_rows]
                # A copy always: a graph's output buffer is overwritten by the next replay.
                out = out.to(self.out_dtype, copy=True)
            else:
                out = self._eager(batch, dev).to(self.out_dtype)
            # One reduction on the device instead of a scan of every row on the host.
            finite = torch.isfinite(out).all()
        ev["m1"].record(compute)
        host_out = torch.empty(out.shape, dtype=self.out_dtype, pin_memory=True)
        host_finite = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._d2h_stream.wait_event(ev["m1"])
        with torch.cuda.stream(self._d2h_stream):
            host_out.copy_(out, non_blocking=True)
            host_finite.copy_(finite, non_blocking=True)
            ev["done"].record()
        out.record_stream(self._d2h_stream)
        finite.record_stream(self._d2h_stream)
        if bucket is None:
            self.stats.variant_batches += self.deterministic
            return _Pending(batch, host_out, 0, False, ev, finite=host_finite)
        return _Pending(batch, host_out, bucket.tokens - batch.n_tokens,
                        bucket.tokens in runner.graphs, ev, finite=host_finite)


class NonFiniteOutput(DsvError):
    """An embedding holds inf or NaN, almost always past the output dtype's range (float16 ends
    at 65504). ``position``: its place in its batch; ``tag``: its ``batching.BatchLoop`` tag."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(message)
        self.position = position
        self.tag: Any = None
