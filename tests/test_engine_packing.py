"""Packed batches (SPEC §5) equal per-image runs; the gather merge equals pad-and-unfold;
bin packing puts every item somewhere, within limits, in nearly full bins."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4enc.tower.model import merge_gather, merge_image
from dsv4enc.engine.packing import aligner_grid, merge_plan, output_grid, pack
from dsv4enc.engine.bins import OPEN_BINS, pack_bins, pack_in_order

from helpers import all_items, packed_forward, rel_err

# Patch grids (n_h, n_w) that need merge padding on one side, both, or none (r = 3).
MIXED_GRIDS = [(1, 1), (2, 5), (4, 4), (7, 3), (10, 1), (3, 6), (5, 8)]


def random_items(grids, patch_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(h * w, patch_dim, generator=gen).to(torch.bfloat16), h, w)
            for h, w in grids]


# --------------------------------------------------------------------------- tower equality

@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_packed_forward_equals_per_image(tiny_tower, features):
    items = random_items(MIXED_GRIDS, tiny_tower.cfg.patch_dim)
    outs = packed_forward(tiny_tower, items, features)
    r = tiny_tower.cfg.downsample_ratio
    for (patches, h, w), out in zip(items, outs):
        with torch.inference_mode():
            ref = tiny_tower.forward_image(patches, h, w, features)
        gh, gw = output_grid(h, w, r, features)
        assert out.shape == (gh * gw, tiny_tower.cfg.output_width(features)), (h, w)
        assert ref.shape == out.shape
        assert rel_err(out, ref) < 1e-5, f"grid {h}x{w}"


def test_packed_forward_does_not_depend_on_order_or_neighbours(tiny_tower):
    # The plain packed forward (whole-batch kernels): equal to float rounding only. The
    # engine's batch-invariant path is held bit for bit in test_engine_invariance.py.
    items = random_items(MIXED_GRIDS, tiny_tower.cfg.patch_dim, seed=1)
    forward = packed_forward(tiny_tower, items)
    backward = packed_forward(tiny_tower, items[::-1])[::-1]
    for a, b, (_, h, w) in zip(forward, backward, items):
        assert rel_err(a, b) < 1e-5, f"grid {h}x{w}"


def test_pack_metadata(tiny_cfg):
    r = tiny_cfg.downsample_ratio
    items = random_items(MIXED_GRIDS, tiny_cfg.patch_dim)
    batch = pack(items, r, "aligner")
    assert batch.lengths == [h * w for h, w in MIXED_GRIDS]
    assert batch.n_tokens == sum(batch.lengths) == batch.positions.shape[0]
    assert batch.grids == MIXED_GRIDS
    assert batch.row_counts == [math.prod(aligner_grid(h, w, r)) for h, w in MIXED_GRIDS]
    assert batch.merge_index.shape == batch.merge_mask.shape == (batch.n_rows, r * r)
    assert int(batch.merge_index.max()) < batch.n_tokens
    assert torch.equal(batch.patches, torch.cat([p for p, _, _ in items]))
    vit_batch = pack(items, r, "vit")
    assert vit_batch.row_counts == batch.lengths
    assert vit_batch.merge_index.shape == (0, r * r)


def test_split_rows_restores_each_image(tiny_cfg):
    batch = pack(random_items(MIXED_GRIDS, tiny_cfg.patch_dim), tiny_cfg.downsample_ratio)
    rows = torch.arange(batch.n_rows).unsqueeze(1)
    parts = batch.split_rows(rows)
    assert [len(p) for p in parts] == batch.row_counts
    assert torch.equal(torch.cat(parts), rows)


# --------------------------------------------------------------------------- merge

@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_merge_plan_matches_merge_image_exhaustively(r):
    gen = torch.Generator().manual_seed(r)
    D = 5
    for n_h in range(1, 10):
        for n_w in range(1, 10):
            vit = torch.randn(n_h * n_w, D, generator=gen)
            ref = merge_image(vit, n_h, n_w, r)
            # Inside a packed batch: other rows before and after this image.
            base = 7
            packed = torch.cat([torch.randn(base, D, generator=gen), vit,
                                torch.randn(3, D, generator=gen)])
            index, mask = merge_plan(n_h, n_w, r, base=base)
            assert index.shape == mask.shape == (math.prod(aligner_grid(n_h, n_w, r)), r * r)
            assert int(mask.sum()) == n_h * n_w  # every patch used once
            assert torch.equal(merge_gather(packed, index, mask), ref), (n_h, n_w, r)


def test_merge_image_feature_order():
    """Feature c*r*r + di*r + dj holds channel c of patch (bi*r+di, bj*r+dj) (SPEC §3.5)."""
    n_h, n_w, r, D = 4, 5, 3, 2
    # Value encodes (row, col, channel) so every position can be read back.
    rows = torch.arange(n_h).view(n_h, 1, 1).expand(n_h, n_w, D)
    cols = torch.arange(n_w).view(1, n_w, 1).expand(n_h, n_w, D)
    chans = torch.arange(D).view(1, 1, D).expand(n_h, n_w, D)
    vit = (1 + rows * 100 + cols * 10 + chans).reshape(n_h * n_w, D).double()
    merged = merge_image(vit, n_h, n_w, r)
    hb, wb = aligner_grid(n_h, n_w, r)
    for bi in range(hb):
        for bj in range(wb):
            for c in range(D):
                for di in range(r):
                    for dj in range(r):
                        i, j = bi * r + di, bj * r + dj
                        want = 1 + i * 100 + j * 10 + c if i < n_h and j < n_w else 0
                        got = merged[bi * wb + bj, c * r * r + di * r + dj].item()
                        assert got == want, (bi, bj, c, di, dj)


def test_merge_gather_zeroes_positions_past_the_edge():
    index, mask = merge_plan(2, 2, 3)
    vit = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert merge_gather(vit, index, mask).tolist() == [[1.0, 2.0, 0, 3.0, 4.0, 0, 0, 0, 0]]


def test_merge_gather_masked_nan_does_not_leak():
    """Masked positions become exact zeros even when the row they point at holds NaN."""
    vit = torch.tensor([[float("nan")], [2.0]])
    out = merge_gather(vit, torch.tensor([[0, 1]]), torch.tensor([[False, True]]))
    assert out.tolist() == [[0.0, 2.0]]


# --------------------------------------------------------------------------- bin packing

def check_bins(costs, capacity, bins, max_items=None):
    """The invariants every pack_bins result must hold."""
    assert sorted(all_items(bins)) == list(range(len(costs))), "each item exactly once"
    for b in bins:
        assert b, "no empty bin"
        assert b == sorted(b)
        load = sum(costs[i] for i in b)
        if max_items is not None:
            assert len(b) <= max_items
        if load > capacity:
            assert len(b) == 1, f"over capacity with {len(b)} items"
    # First fit: two bins that could be merged never both exist (unless a count limit stops it).
    normal = [b for b in bins if sum(costs[i] for i in b) <= capacity]
    for x in range(len(normal)):
        for y in range(x + 1, len(normal)):
            a, b = normal[x], normal[y]
            mergeable = sum(costs[i] for i in a + b) <= capacity
            full = max_items is not None and max_items in (len(a), len(b))
            assert not mergeable or full, f"bins {a} and {b} fit together"


@given(costs=st.lists(st.integers(1, 3000), max_size=60),
       capacity=st.integers(1, 8192),
       max_items=st.one_of(st.none(), st.integers(1, 8)))
def test_pack_bins_invariants(costs, capacity, max_items):
    bins = pack_bins(costs, capacity, max_items)
    check_bins(costs, capacity, bins, max_items)


def test_pack_bins_oversize_items_get_their_own_bin():
    costs = [5000, 10, 9000, 20, 4096]
    bins = pack_bins(costs, 4096)
    check_bins(costs, 4096, bins)
    assert [0] in bins and [2] in bins and [4] in bins
    assert [1, 3] in bins


def test_pack_bins_max_items_limits_count():
    bins = pack_bins([1] * 10, 100, max_items=3)
    assert sorted(len(b) for b in bins) == [1, 3, 3, 3]


def test_pack_bins_fills_bins_nearly_full():
    """A realistic mix of patch counts: close to the volume lower bound ceil(sum / capacity)."""
    rng = random.Random(0)
    costs = [rng.choice([784, 975, 1610, 2592, 2976]) + rng.randint(-200, 200)
             for _ in range(300)]
    capacity = 16384
    bins = pack_bins(costs, capacity)
    check_bins(costs, capacity, bins)
    lower = math.ceil(sum(costs) / capacity)
    assert len(bins) <= lower + 1, f"{len(bins)} bins, lower bound {lower}"
    loads = sorted(sum(costs[i] for i in b) for b in bins)
    assert sum(loads[1:]) / (capacity * (len(loads) - 1)) > 0.9  # all but one bin > 90% full


def test_pack_bins_orders_bins_by_first_index_and_handles_empty():
    assert pack_bins([], 10) == []
    bins = pack_bins([3, 9, 2, 8, 1], 10)
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)


@given(costs=st.lists(st.integers(1, 3000), max_size=60),
       capacity=st.integers(1, 8192),
       max_items=st.one_of(st.none(), st.integers(1, 8)))
def test_pack_in_order_keeps_each_item_near_its_neighbours(costs, capacity, max_items):
    """Each item once, within capacity (or alone), bins ordered by their first item, and an
    item never lands more than OPEN_BINS - 1 bins before the latest bin used before it: the
    batches finish roughly in input order (a gathered part is committed from its start)."""
    bins = pack_in_order(costs, capacity, max_items)
    assert sorted(all_items(bins)) == list(range(len(costs)))
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    for b in bins:
        assert b == sorted(b) and (max_items is None or len(b) <= max_items)
        assert sum(costs[i] for i in b) <= capacity or len(b) == 1
    bin_of = {i: k for k, b in enumerate(bins) for i in b}
    latest = -1
    for i in range(len(costs)):
        assert bin_of[i] >= latest - (OPEN_BINS - 1)
        latest = max(latest, bin_of[i])


def test_pack_in_order_fills_bins_nearly_as_well():
    """The realistic mix of ``test_pack_bins_fills_bins_nearly_full``: a few more bins."""
    rng = random.Random(0)
    costs = [rng.choice([784, 975, 1610, 2592, 2976]) + rng.randint(-200, 200)
             for _ in range(300)]
    lower = math.ceil(sum(costs) / 16384)
    assert len(pack_in_order(costs, 16384)) <= lower * 1.1 + 1
