"""Static-shape execution of packed batches: token budgets, padding, CUDA graphs.

A *bucket* fixes every shape of one packed forward: T tokens (the budget), R aligner rows, B
images and the ``max_seqlen`` handed to the attention kernel. A batch runs in the smallest
bucket that holds it, padded up to the bucket's shapes, and the padding cannot leak:

- the B+1 ``cu_seqlens`` slots past the real images repeat the last offset (zero-length
  sequences), so attention never reads or writes the tokens past the real ones, and all
  other ops are row-wise, so whatever those rows hold stays in those rows;
- merge rows past the real ones point at row 0 (always a real token) with an all-False mask,
  and ``merge_gather`` selects with ``where``, so even NaN garbage stays out of them;
- only the first ``rows`` output rows are read back."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections import Counter
from typing import Sequence

import torch

from ..tower.attention import VarlenSpans
from ..tower.model import VisionTower, rope_table, rope_tables
from .packing import PackedBatch

log = logging.getLogger(__name__)

#: Attention backends that read only device tensors, so a CUDA graph can hold them.
GRAPH_BACKENDS = ("flash", "varlen")


def default_budgets(batch_tokens: int, min_tokens: int = 1024) -> list[int]:
    """Powers of two from ``min_tokens`` below ``batch_tokens``, then ``batch_tokens`` itself."""
    budgets = []
    t = 1 << max(0, math.ceil(math.log2(max(1, min(min_tokens, batch_tokens)))))
    while t < batch_tokens:
        budgets.append(t)
        t *= 2
    return budgets + [batch_tokens]


def fit_budgets(bin_tokens: Sequence[int], max_budgets: int = 4, quantum: int = 64) -> list[int]:
    """At most ``max_budgets`` budgets that minimise the summed padding of the batches known
    up front (``bin_tokens``, each rounded up to ``quantum``), each batch taking the smallest
    budget that holds it; the largest size is always one. An optimal set only needs batch sizes
    as budgets (lowering one to the largest size it serves only removes padding), so a dynamic
    program over the m distinct sizes is exact."""
    sizes = Counter(-(-n // quantum) * quantum for n in bin_tokens if n > 0)
    if not sizes:
        return []
    vals = sorted(sizes)
    m = len(vals)
    # pad(i, j): padding of the sizes i..j (inclusive) served by budget vals[j].
    pre_c = [0, *itertools.accumulate(sizes[v] for v in vals)]
    pre_s = [0, *itertools.accumulate(sizes[v] * v for v in vals)]

    def pad(i: int, j: int) -> int:
        return vals[j] * (pre_c[j + 1] - pre_c[i]) - (pre_s[j + 1] - pre_s[i])

    k_max = min(max_budgets, m)
    # best[k][j]: least padding of sizes 0..j with k budgets, the largest being vals[j].
    best = [[float("inf")] * m for _ in range(k_max + 1)]
    choice = [[-1] * m for _ in range(k_max + 1)]
    best[1] = [pad(0, j) for j in range(m)]
    for k in range(2, k_max + 1):
        for j in range(m):  # the cheapest split, the lowest i among equals
            best[k][j], choice[k][j] = min(((best[k - 1][i] + pad(i + 1, j), i) for i in range(j)),
                                           default=(float("inf"), -1))
    k = min(range(1, k_max + 1), key=lambda k: (best[k][m - 1], k))
    out, j = [], m - 1
    while k >= 1 and j >= 0:
        out.append(vals[j])
        j, k = choice[k][j], k - 1
    return sorted(out)


def row_bound(tokens: int, images: int, r: int = 3, max_aspect: float = 8.0) -> int:
    """Upper bound on aligner rows of any batch of <= ``images`` images, <= ``tokens`` patches,
    each grid's long side at most ``max_aspect`` (A) times its short side:

        r^2 * rows <= T + (r-1) * c * sqrt(B*T) + B * (r-1)^2,  c = sqrt(A) + 1/sqrt(A),

    since one n_h x n_w grid gives r^2 * rows <= (n_h + r-1)(n_w + r-1), n_h + n_w <=
    c * sqrt(n_h*n_w), and sum sqrt(N_i) <= sqrt(B*T) (Cauchy-Schwarz); also rows <= T. A batch
    outside the aspect assumption is still checked exactly (``BucketRunner.choose``): it takes
    a larger bucket or runs eagerly, never overflows."""
    c = math.sqrt(max_aspect) + 1.0 / math.sqrt(max_aspect)
    bound = (tokens + (r - 1) * c * math.sqrt(images * tokens) + images * (r - 1) ** 2) / r ** 2
    return max(1, min(tokens, math.floor(bound)))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Fixed shapes of one static forward."""

    tokens: int  # T: padded token count
    rows: int  # R: output rows (T for ViT features)
    images: int  # B: sequences in cu_seqlens (B+1 entries)
    max_seqlen: int  # handed to the attention kernel; every real image must fit


@dataclasses.dataclass
class StagedInputs:
    """A batch laid out for one bucket (host or device tensors). patches (n, 3*p*p) and
    positions (n, 2) hold the n real tokens only (no real row reads the bucket's tail, so it
    is not copied); cu_seqlens (B+1,) int32 and merge_index / merge_mask (R, r*r) are
    full-size, padding filled in. lengths: real span lengths then zeros, B entries (host)."""

    patches: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    merge_index: torch.Tensor | None
    merge_mask: torch.Tensor | None
    lengths: tuple[int, ...]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (the merge plan only for aligner features)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


class BucketRunner:
    """Runs packed batches in fixed-shape buckets, eagerly or as captured CUDA graphs: one set
    of input buffers for the largest bucket, of which each reads a prefix, and with ``capture``
    one graph per bucket in one shared pool (smaller graphs reuse the largest one's scratch)."""

    def __init__(self, model: VisionTower, features: str, budgets: Sequence[int],
                 max_images: int, max_seqlen: int | None = None, capture: bool = False) -> None:
        if not budgets:
            raise ValueError("no token budgets")
        self.model = model
        self.features = features
        self.device = model.device
        self.capture = capture
        cfg = model.cfg
        self.r = cfg.downsample_ratio
        # Every coordinate is below an image's token count, so below max_seqlen: build the RoPE
        # tables that far now (a graph capture cannot grow them).
        seq_cap = self.max_position = max_seqlen or max(budgets)
        rope_table(cfg, self.device, seq_cap + 1)
        self.buckets = [
            Bucket(tokens=t,
                   rows=t if features == "vit" else row_bound(t, max_images, self.r),
                   images=max_images, max_seqlen=min(t, seq_cap))
            for t in sorted(set(int(b) for b in budgets))]
        top = self.buckets[-1]
        rr = self.r * self.r
        dev = self.device
        with torch.inference_mode():
            # In the compute dtype: the patch embedding casts to it anyway, and a bf16 input
            # (what the transform makes) converts exactly.
            self.patches = torch.zeros(top.tokens, cfg.patch_dim, dtype=model.dtype, device=dev)
            self.positions = torch.zeros(top.tokens, 2, dtype=torch.int32, device=dev)
            self.cu_seqlens = torch.zeros(max_images + 1, dtype=torch.int32, device=dev)
            max_rows = max(b.rows for b in self.buckets) if features == "aligner" else 0
            self.merge_index = torch.zeros(max_rows, rr, dtype=torch.int64, device=dev)
            self.merge_mask = torch.zeros(max_rows, rr, dtype=torch.bool, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0

    def choose(self, batch: PackedBatch) -> Bucket | None:
        """Smallest bucket that holds the batch's tokens, rows, images and longest image."""
        rows = batch.n_rows if self.features == "aligner" else batch.n_tokens
        longest = max(batch.lengths, default=0)
        return next((b for b in self.buckets if batch.n_tokens <= b.tokens and rows <= b.rows
                     and len(batch.lengths) <= b.images and longest <= b.max_seqlen), None)

    def stage(self, batch: PackedBatch, bucket: Bucket) -> StagedInputs:
        """Host tensors of ``batch`` padded to ``bucket`` (see StagedInputs)."""
        lengths = tuple(batch.lengths) + (0,) * (bucket.images - len(batch.lengths))
        cu = VarlenSpans.from_lengths(lengths, "cpu").cu_seqlens
        index = mask = None
        if self.features == "aligner":  # zero index, False mask: see the module doc
            pad = (bucket.rows - batch.merge_index.shape[0], self.r * self.r)
            index = torch.cat([batch.merge_index, torch.zeros(pad, dtype=torch.int64)])
            mask = torch.cat([batch.merge_mask, torch.zeros(pad, dtype=torch.bool)])
        return StagedInputs(batch.patches, batch.positions, cu, index, mask, lengths)

    @torch.inference_mode()
    def load(self, staged: StagedInputs) -> None:
        """Copy staged inputs (host or device) into the prefixes of the same-named buffers."""
        for name, tensor in staged.tensors().items():
            getattr(self, name)[:tensor.shape[0]].copy_(tensor)

    def _forward(self, bucket: Bucket, lengths: tuple[int, ...] | None) -> torch.Tensor:
        """The static-shape forward over the buffers' prefixes: (R, width) or (T, D)."""
        T, R = bucket.tokens, bucket.rows
        # RoPE tables come from the positions buffer inside the forward: a (T, 2) int32 copy
        # instead of two (T, 1, rd) float32 tables per batch.
        cos, sin = rope_tables(self.positions[:T], self.model.cfg, self.max_position)
        spans = VarlenSpans(self.cu_seqlens, bucket.max_seqlen, lengths)
        index = self.merge_index[:R] if self.features == "aligner" else None
        mask = self.merge_mask[:R] if self.features == "aligner" else None
        return self.model.forward_packed(self.patches[:T], cos, sin, spans, index, mask,
                                         features=self.features)

    @torch.inference_mode()
    def run(self, bucket: Bucket, lengths: tuple[int, ...]) -> torch.Tensor:
        """Forward of what ``load`` put in the buffers: the bucket's R or T rows, the batch's
        first. With graphs, the graph's static output, valid until the next ``run`` of any
        bucket (another graph's scratch may overlay it): copy it first, on the same stream."""
        graph = self.graphs.get(bucket.tokens)
        if graph is not None:
            graph.replay()
            return self.outputs[bucket.tokens]
        return self._forward(bucket, lengths)

    def capture_all(self) -> None:
        """Capture one graph per bucket (largest first, one pool); on an error, stay eager."""
        if not self.capture or self.graphs:
            return
        began = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for bucket in sorted(self.buckets, key=lambda b: -b.tokens):
                    t0 = time.perf_counter()
                    side = torch.cuda.Stream(self.device)
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    # Warm-up off the capture: lazy inits (cuBLAS handles, workspaces,
                    # kernel selection) must not happen inside the graph.
                    with torch.cuda.stream(side):
                        for _ in range(2):
                            self._forward(bucket, None)
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bucket, None)
                    self.graphs[bucket.tokens] = graph
                    self.outputs[bucket.tokens] = out
                    log.info("captured CUDA graph: %d tokens, %d rows, %d images, max_seqlen "
                             "%d in %.2f s", bucket.tokens, bucket.rows, bucket.images,
                             bucket.max_seqlen, time.perf_counter() - t0)
        except Exception as exc:  # a backend that cannot be captured: stay eager
            log.warning("CUDA graph capture failed (%s: %s); running eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.graphs.clear()
            self.outputs.clear()
            self.capture = False
            return
        finally:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - began
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d CUDA graphs in %.2f s, %.0f MiB of device memory",
                 len(self.graphs), self.capture_s, used / 2 ** 20)

    def encode_host(self, batch: PackedBatch) -> torch.Tensor | None:
        """Whole static path for a host-side caller (tests, CPU): choose, stage, load, run.
        Returns (rows, width) in the compute dtype, or None when no bucket holds the batch."""
        bucket = self.choose(batch)
        if bucket is None:
            return None
        staged = self.stage(batch, bucket)
        self.load(staged)
        return self.run(bucket, staged.lengths)[:batch.n_rows].clone()
