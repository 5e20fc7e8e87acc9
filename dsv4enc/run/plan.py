"""The run's plan, made a window ahead of the encoder: the parts (consecutive input ranges
cut where the inputs' keys say: the unit of commit and resume), and for each range to encode
its images' grids from their headers (probed by ``images/headers``, shared between ranks
here), its segments with their share per rank, and its batches.

A part ends after an input whose key hashes lower than every key within ``part_images // 2``
inputs on either side (content-defined boundaries, as backup tools chunk files): a boundary
depends on the keys near it alone, so inputs added or removed anywhere move only the
boundaries around them, and ``--update`` writes again only the parts there. A part holds at
least ``part_images // 4`` inputs (but the last) and at most ``2 * part_images - 1`` (cut
there when no key says so); it holds about ``part_images`` on average."""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Iterator, Sequence

import numpy as np

from ..engine.bins import pack_bins, pack_in_order
from ..engine.defaults import DEFAULT_FEATURES
from ..errors import UsageError
from .options import BALANCE_CHOICES
from ..images.decode import Probe
from ..images.headers import PROBE_TIMEOUT_S, Planned, inputs_digest, keys_digest, probe_all
from ..images.items import InputItem
from ..output import files
from ..images.sources import GROUP_CACHE
from ..tower.config import VisionConfig
from ..tower.transform import plan_canvas

if TYPE_CHECKING:
    from .options import EncodeOptions
    from .ranks import Topology

PART_BYTES = 256 << 20  # upper bound of one part's embeddings in memory
# Parts of small models are capped in images: writing a part's Parquet takes transient memory
# several times its embeddings (float16 most), and up to four parts are in flight.
MAX_PART_IMAGES = 1024


def probe_share(items: Sequence[InputItem], max_pixels: int, ranks: Topology | None = None,
                should_stop: Callable[[], bool] | None = None,
                timeout_s: float | None = PROBE_TIMEOUT_S) -> list[tuple[int, Probe]]:
    """This rank's share of the probes of ``items`` (every ``world_size``-th), as ``(index,
    probe)``; no collective (any thread). A probe slower than ``timeout_s`` is an error (its
    daemon thread left behind); once ``should_stop()``, unread ones are errors not to plan."""
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    mine = list(range(rank, len(items), world))
    probes = probe_all([items[i] for i in mine], max_pixels, should_stop, timeout_s)
    # Table row groups read for the probes: their cells are held for the decode (``HELD``),
    # or the workers read their own; the furthest of each column may start the next window.
    GROUP_CACHE.release()
    return list(zip(mine, probes))


def with_grids(items: Sequence[InputItem], share: list[tuple[int, Probe]], cfg: VisionConfig,
               ranks: Topology | None = None, start: int = 0) -> list[Planned]:
    """Every item of ``items`` (inputs from ``start`` on) planned from the ranks' shares of
    probes (``share``: this rank's; under data parallelism the ranks exchange theirs: a
    collective, refused where the ranks' items differ)."""
    if ranks is not None and ranks.world_size > 1:
        shared = ranks.gather_listed([(i, asdict(p)) for i, p in share], start,
                                     keys_digest(items))
        by_index = {i: Probe(**p) for part in shared for i, p in part}
    else:
        by_index = dict(share)
    planned = []
    for index, item in enumerate(items):
        probe = by_index[index]
        entry = Planned(item, probe.width, probe.height, error=probe.error, misnamed=probe.misnamed)
        if probe.error is None:
            try:
                canvas = plan_canvas(probe.width, probe.height, cfg)
                entry.n_h, entry.n_w = canvas.n_h, canvas.n_w
            except ValueError as exc:
                entry.error = f"ValueError: {exc}"
        planned.append(entry)
    return planned


def images_per_part(cfg: VisionConfig, opts: EncodeOptions) -> int:
    """The parts' target size (``--part-images``, or so that the longest part's embeddings
    stay under PART_BYTES even at the largest grid); from the config and output settings
    only, so that a resumed run cuts the same parts."""
    if opts.part_images:
        return opts.part_images
    max_patches = (cfg.max_n_token * cfg.downsample_ratio ** 2 if opts.engine.features == "vit"
                   else cfg.max_n_token)
    per_image = _row_bytes(cfg, opts) * (1 if opts.pool == "mean" else max_patches)
    longest = int(min(MAX_PART_IMAGES, max(16, PART_BYTES // per_image)))
    return (longest + 1) // 2  # the longest part: 2 * target - 1


def _row_bytes(cfg: VisionConfig, opts: EncodeOptions) -> int:
    return cfg.output_width(opts.engine.features) * (2 if opts.out_dtype == "float16" else 4)


def output_bytes(cfg: VisionConfig, opts: EncodeOptions, planned: Sequence[Planned]) -> int:
    """About how many bytes the run's embeddings take (``planned``: every input's grid):
    what a single-file output's store must take in one object."""
    if opts.pool == "mean":
        return _row_bytes(cfg, opts) * sum(1 for p in planned if p.error is None)
    merged = 1 if opts.engine.features == "vit" else cfg.downsample_ratio ** 2  # patches per row
    return _row_bytes(cfg, opts) * sum(p.tokens // merged for p in planned)


#: Batches' worth of patches per segment (the unit a run encodes and may commit at): enough
#: for nearly full batches, few enough that a commit comes soon after --commit-every (CPU
#: batches are slow and unpadded: one; GPU ones fast and padded to graph budgets).
SEGMENT_BATCHES = {"cpu": 1, "cuda": 8}


def segment_tokens(batch_tokens: int, device_type: str) -> int:
    """Patches per segment for a run of ``batch_tokens`` batches on ``device_type``."""
    return batch_tokens * SEGMENT_BATCHES.get(device_type, 2)


def part_name(start: int, part_images: int) -> str:
    """The name of the part (or segment) that starts at input ``start``: ``part-NNNNNN`` where
    ``start`` is NNNNNN times ``part_images``, ``part-NNNNNN_OOOOOO`` OOOOOO inputs further
    (one name per start; names sort in input order)."""
    number, offset = divmod(start, part_images)
    return files.part_name(number, offset)


@dataclass
class Part:
    name: str
    start: int
    end: int
    indices: Sequence[int]  # the planned items this part covers (all of start..end unless sharded)
    # ``inputs_digest`` of start..end: a resumed run reuses the part only for the same keys
    # and the same input files (size, time, ...); "" for a range not planned yet
    digest: str
    # data parallel: every rank's share of start..end (failed items included), by rank
    shares: list[list[int]] | None = field(default=None, repr=False, compare=False)
    part_images: int = field(default=0, repr=False, compare=False)  # the parts' target size
    part_end: int = field(default=0, repr=False, compare=False)  # where the part ends (a segment's)

    def __post_init__(self) -> None:
        self.part_end = self.part_end or self.end

    def rest(self, start: int) -> "Part":
        """What is left of this range from ``start`` on (a resumed run's remainder)."""
        return Part(part_name(start, self.part_images), start, self.end,
                    range(start, self.end), "", part_images=self.part_images,
                    part_end=self.part_end)


def _segments(planned: Sequence[Planned], start: int, end: int,
              tokens: int | None) -> list[tuple[int, int]]:
    """``start..end`` cut into consecutive runs of at most ``tokens`` patches (an image
    larger than that alone); the whole range when ``tokens`` is None."""
    if tokens is None:
        return [(start, end)]
    cuts, first, total = [], start, 0
    for i in range(start, end):
        cost = planned[i].tokens if planned[i].error is None else 0
        if total and total + cost > tokens:
            cuts.append((first, i))
            first, total = i, 0
        total += cost
    return cuts + [(first, end)] if end > first else cuts


def part_sizes(part_images: int) -> tuple[int, int, int]:
    """``(shortest, longest, reach)`` of the parts cut for a target of ``part_images``: the
    fewest and most inputs a part holds (the last excepted) and how many keys on either side
    a boundary's key must hash lower than."""
    return max(1, part_images // 4), 2 * part_images - 1, part_images // 2


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """Each key's 64-bit hash (BLAKE2b of its UTF-8 bytes: the same on every machine)."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(
        key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
        for key in keys), dtype=np.uint64, count=len(keys))


class _Hashes:
    """The inputs' key hashes from ``first`` on (those before it are dropped as the cut
    passes them): each key is hashed once."""

    def __init__(self, planned: Sequence[Planned]) -> None:
        self.planned = planned
        self.first = 0
        self.values = np.empty(0, dtype=np.uint64)

    def span(self, start: int, end: int) -> np.ndarray:
        """The hashes of inputs ``start..end`` (``start`` never below an earlier call's)."""
        have = self.first + len(self.values)
        if end > have:
            more = key_hashes([p.item.key for p in self.planned[have:end]])
            self.values = np.concatenate([self.values, more])
        self.values = self.values[start - self.first:]
        self.first = start
        return self.values[:end - start]


_HIGHEST = np.iinfo(np.uint64).max


def lowest_in_reach(hashes: np.ndarray, reach: int) -> np.ndarray:
    """Whether each of ``hashes[reach:-reach]`` is lower than every hash within ``reach``
    places on either side (one bool each)."""
    windows = np.lib.stride_tricks.sliding_window_view(hashes, 2 * reach + 1)
    middle = windows[:, reach]
    return ((middle < windows[:, :reach].min(axis=1, initial=_HIGHEST))
            & (middle < windows[:, reach + 1:].min(axis=1, initial=_HIGHEST)))


def _part_end(hashes: _Hashes, start: int, count: int, part_images: int) -> int:
    """Where the part that starts at ``start`` ends, of ``count`` inputs listed (every
    input up to the longest part's end and ``reach`` keys past it, or all there are)."""
    shortest, longest, reach = part_sizes(part_images)
    last = min(start + longest, count)  # no key says where: the longest part (or the rest)
    first = start + shortest - 1  # the first input a part may end after
    if first >= last - 1:
        return last
    # the keys within reach of inputs first..last-1; past the list's ends, the highest hash
    low, high = max(0, first - reach), min(count, last - 1 + reach)
    padded = np.concatenate([np.full(low - (first - reach), _HIGHEST, np.uint64),
                             hashes.span(low, high),
                             np.full(last - 1 + reach - high, _HIGHEST, np.uint64)])
    found = np.flatnonzero(lowest_in_reach(padded, reach))
    return first + int(found[0]) + 1 if len(found) else last


def cut_parts(planned: list[Planned], part_images: int,
              more: Callable[[int], None] = lambda count: None) -> Iterator[Part]:
    """The run's parts: consecutive ranges cut where their keys say (the module's doc; their
    bounds known before any header is read, the same on resume), each as soon as
    ``more(count)`` has listed its inputs into ``planned`` (by default it is whole)."""
    _, longest, reach = part_sizes(part_images)
    hashes = _Hashes(planned)
    start = 0
    while True:
        more(start + longest + reach)
        if start >= len(planned):
            return
        end = _part_end(hashes, start, len(planned), part_images)
        yield Part(part_name(start, part_images), start, end, range(start, end), "",
                   part_images=part_images)
        start = end


def plan_segments(planned: Sequence[Planned], part: Part, ranks: Topology | None = None,
                  balance: str = "patches", cfg: VisionConfig | None = None,
                  segment_tokens: int | None = None) -> list[Part]:
    """The segments a run encodes of ``part`` (its headers read, its inputs stamped):
    consecutive ranges of at most ``segment_tokens`` patches (None: the whole range), which the
    writer joins into a committed part until the range ends or --commit-every passes. When the
    ranks split the images, the range is one segment carrying every rank's greedy share (with
    ``--shard-output`` a rank's part holds just its own)."""
    start, end, size = part.start, part.end, part.part_images
    if ranks is not None and ranks.splits_images:
        shares = share_for_ranks(planned, list(range(start, end)), ranks.world_size, balance, cfg)
        name, indices = part.name, range(start, end)
        if ranks.sharded:
            name, indices = files.rank_name(name, ranks.rank), shares[ranks.rank]
        return [Part(name, start, end, indices, inputs_digest(planned[start:end]), shares,
                     part_images=size, part_end=part.part_end)]
    return [Part(part_name(first, size), first, last, range(first, last),
                 inputs_digest(planned[first:last]), part_images=size, part_end=part.part_end)
            for first, last in _segments(planned, start, end, segment_tokens)]


# ----------------------------------------------------------------------------- ranks

def patch_cost(n_h: int, n_w: int) -> float:
    """Cost of an image: its patch count (the default ``--balance``)."""
    return float(n_h * n_w)


def image_flops(cfg: VisionConfig, n_h: int, n_w: int, features: str = DEFAULT_FEATURES) -> float:
    """Forward FLOPs of one n_h x n_w image (2 per multiply-add): patch embed, per layer the
    QKV, output and MLP matmuls (2*N*(4D^2 + 3*D*I)) and attention (QK^T and PV: 4*N^2*D),
    and, for aligner features, the aligner's two matmuls over the merged r x r rows."""
    N, D, I, L = n_h * n_w, cfg.dim, cfg.inter_dim, cfg.n_layers
    flops = 2.0 * N * cfg.patch_dim * D
    flops += L * (2.0 * N * D * (4 * D + 3 * I) + 4.0 * N * N * D)
    if features == "aligner":
        r = cfg.downsample_ratio
        rows = -(-n_h // r) * -(-n_w // r)
        hid = cfg.hidden_size
        flops += 2.0 * rows * (D * r * r * hid + hid * hid)
    return flops


def flops_cost(n_h: int, n_w: int, cfg: VisionConfig) -> float:
    """Cost of an image in "patch equivalents": forward FLOPs (``image_flops``) over one
    patch's through the ViT's linear layers (near the patch count, growing with N^2)."""
    per_patch = 2.0 * cfg.dim * (4 * cfg.dim + 3 * cfg.inter_dim) * cfg.n_layers
    return image_flops(cfg, n_h, n_w) / per_patch


def cost_function(balance: str, cfg: VisionConfig) -> Callable[[int, int], float]:
    """``(n_h, n_w) -> cost`` for ``--balance patches|flops``."""
    if balance == "patches":
        return patch_cost
    if balance == "flops":
        return lambda n_h, n_w: flops_cost(n_h, n_w, cfg)
    raise UsageError(f"unknown --balance {balance!r} (choose from {', '.join(BALANCE_CHOICES)})")


def assign_greedy(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Greedy longest-first assignment of images to ranks: by cost descending (ties: lower
    index first), each to the least loaded rank (ties: lowest rank). One ascending list of
    image indices per rank; deterministic, so every rank computes the same plan."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    heap = [(0.0, rank) for rank in range(world_size)]  # (load, rank): ties pop lowest rank
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        assignment[rank].append(i)
        heapq.heappush(heap, (load + costs[i], rank))
    return [sorted(indices) for indices in assignment]


def share_for_ranks(planned: Sequence[Planned], indices: list[int], world_size: int,
                    balance: str, cfg: VisionConfig | None = None) -> list[list[int]]:
    """Greedy assignment of ``indices`` to ranks by cost (``--balance``); failed items cost
    nothing (they go last, so they move no other item)."""
    cost = cost_function(balance, cfg) if cfg is not None else patch_cost
    costs = [cost(planned[i].n_h, planned[i].n_w) if planned[i].error is None else 0
             for i in indices]
    return [[indices[j] for j in share] for share in assign_greedy(costs, world_size)]


def part_batches(planned: Sequence[Planned], indices: Sequence[int], batch_tokens: int,
                 max_images: int | None, in_order: bool = False) -> list[list[int]]:
    """The batches (lists of item indices) that ``indices`` are encoded in: the readable
    items, packed first-fit-decreasing by patch count (``in_order``: ``pack_in_order``)."""
    good = [i for i in indices if planned[i].error is None]
    pack = pack_in_order if in_order else pack_bins
    bins = pack([planned[i].tokens for i in good], batch_tokens, max_images)
    return [[good[j] for j in b] for b in bins]


def plan_batches(planned: Sequence[Planned], parts: Sequence[Part], batch_tokens: int,
                 max_images: int | None, carried: Collection[int] = (),
                 in_order: bool = False) -> list[list[list[int]]]:
    """Per part, per rank (one share without data parallelism), the batches it is encoded
    in. Every rank plans every rank's batches, so that all take the same number of steps
    (each ends in collectives). ``carried`` (rows ``--update`` copies: up to every input's,
    so looked up, never copied per window) are in no batch.
    ``in_order``: batches filled in input order (``pack_in_order``), so that a part encoded
    whole by several ranks finishes from its start on and is committed in pieces as it goes."""
    return [[part_batches(planned, [i for i in share if i not in carried], batch_tokens,
                          max_images, in_order)
             for share in (part.shares if part.shares is not None else [part.indices])]
            for part in parts]
