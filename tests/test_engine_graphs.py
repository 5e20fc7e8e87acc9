"""Static-shape path (token budgets, padding, buffers) and the bounds it rests on.

The bucket runner without capture runs the exact code path a CUDA graph replays, so on the
CPU it is checked against the plain packed forward; the CUDA cases at the bottom compare
captured graphs with the eager engine.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, strategies as st

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.engine.engine import Engine
from dsv4enc.errors import UsageError
from dsv4enc.engine.graphs import BucketRunner, default_budgets, fit_budgets, row_bound
from dsv4enc.engine.packing import aligner_grid, pack
from dsv4enc.tower.transform import max_image_tokens, plan_canvas

from helpers import load_config, needs_cuda, packed_forward, rel_err

GRIDS = [(5, 7), (3, 3), (10, 4), (1, 1), (2, 9), (7, 7)]


def _items(grids, cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(h * w, cfg.patch_dim, generator=gen).to(torch.bfloat16), h, w)
            for h, w in grids]


# ----------------------------------------------------------------------------- budgets, bounds

def test_default_budgets():
    assert default_budgets(32768, 1024) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert default_budgets(12000, 1024) == [1024, 2048, 4096, 8192, 12000]
    assert default_budgets(500, 1024) == [500]
    assert default_budgets(1000, 300) == [512, 1000]


def _padding(sizes, budgets):
    return sum(min(b for b in budgets if b >= s) - s for s in sizes)


def test_fit_budgets_homogeneous_bins_need_no_padding():
    bins = [15360] * 9 + [6144]
    assert fit_budgets(bins, max_budgets=4) == [6144, 15360]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 4))
def test_fit_budgets_is_optimal(units, k):
    sizes = [u * 64 for u in units]
    budgets = fit_budgets(sizes, max_budgets=k, quantum=64)
    assert max(budgets) == max(sizes) and len(budgets) <= k
    distinct = sorted(set(sizes))
    best = min(_padding(sizes, list(c) + [max(sizes)])
               for n in range(k) for c in itertools.combinations(distinct[:-1], n))
    assert _padding(sizes, budgets) == best


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_max_image_tokens_bounds_the_transform(width, height):
    cfg = load_config("deepseek-v4-flash")
    assert plan_canvas(width, height, cfg).n_patches <= max_image_tokens(cfg)


@given(st.lists(st.tuples(st.integers(1, 60), st.floats(1.0, 8.0), st.booleans()),
                min_size=1, max_size=16))
def test_row_bound_holds_for_bounded_aspect(shapes):
    grids = []
    for short, aspect, tall in shapes:
        long = max(short, math.floor(short * aspect))
        grids.append((long, short) if tall else (short, long))
    tokens = sum(h * w for h, w in grids)
    rows = sum(math.prod(aligner_grid(h, w, 3)) for h, w in grids)
    assert rows <= row_bound(tokens, len(grids), 3, 8.0)
    assert rows <= row_bound(tokens + 100, 16, 3, 8.0)  # looser budget and image count


def test_row_bound_is_tight_enough_at_real_dims():
    # Spare aligner rows must stay a small fraction of the budget (each costs ~13% of a patch).
    assert row_bound(32768, 64) < 1.35 * 32768 / 9


# ----------------------------------------------------------------------------- static path on CPU

@pytest.fixture(scope="module")
def tower():
    return build_tower(random_checkpoint(load_config("tiny"), seed=3, dtype=torch.float32))


def _runner(tower, features="aligner", budgets=(64, 128, 512), images=8, max_seqlen=None):
    return BucketRunner(tower, features, budgets, images, max_seqlen=max_seqlen, capture=False)


@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_static_path_equals_packed_forward(tower, features):
    items = _items(GRIDS, tower.cfg)
    runner = _runner(tower, features)
    batch = pack(items, 3, features)
    bucket = runner.choose(batch)
    assert bucket is not None and bucket.tokens == 512 > batch.n_tokens  # padded
    out = runner.encode_host(batch)
    expected = torch.cat(packed_forward(tower, items, features))
    assert out.shape == expected.shape
    assert rel_err(out, expected) < 1e-6


def test_stage_pads_the_tail(tower):
    runner = _runner(tower)
    batch = pack(_items([(5, 7), (2, 2)], tower.cfg), 3)
    bucket = runner.choose(batch)
    staged = runner.stage(batch, bucket)
    assert staged.cu_seqlens.tolist() == [0, 35, 39] + [39] * (bucket.images - 2)
    assert staged.lengths == (35, 4) + (0,) * (bucket.images - 2)
    n = batch.n_rows
    assert staged.merge_index.shape == (bucket.rows, 9)
    assert torch.equal(staged.merge_index[:n], batch.merge_index)
    assert not staged.merge_mask[n:].any() and (staged.merge_index[n:] == 0).all()


def test_garbage_in_padding_cannot_leak(tower):
    """Stale or NaN data in the buffers' tails (as a graph replay leaves them) changes nothing."""
    runner = _runner(tower)
    small = _items([(4, 5), (3, 3)], tower.cfg, seed=1)
    expected = torch.cat(packed_forward(tower, small))
    runner.encode_host(pack(_items(GRIDS, tower.cfg), 3))  # leaves real data in the tails
    with torch.inference_mode():
        runner.patches[29:].fill_(float("nan"))
    out = runner.encode_host(pack(small, 3))
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 1e-6


def test_bucket_choice(tower):
    cfg = tower.cfg
    runner = _runner(tower, budgets=(64, 128, 512), images=4, max_seqlen=100)
    assert runner.choose(pack(_items([(5, 7)], cfg), 3)).tokens == 64
    assert runner.choose(pack(_items([(5, 7), (5, 7)], cfg), 3)).tokens == 128
    # Too many images for the slots, or one image longer than max_seqlen: no bucket.
    assert runner.choose(pack(_items([(1, 1)] * 5, cfg), 3)) is None
    assert runner.choose(pack(_items([(11, 11)], cfg), 3)) is None
    # Thin grids: more rows than the token-tight bucket allows -> a larger bucket.
    thin = pack(_items([(1, 16)] * 4, cfg), 3)  # 64 tokens, 24 rows
    assert thin.n_rows > runner.buckets[0].rows
    assert runner.choose(thin).tokens == 128


def test_oversize_batch_has_no_bucket(tower):
    runner = _runner(tower, budgets=(64,))
    assert runner.choose(pack(_items([(9, 9)], tower.cfg), 3)) is None
    assert runner.encode_host(pack(_items([(9, 9)], tower.cfg), 3)) is None


# ----------------------------------------------------------------------------- engine on CPU

def test_engine_cpu_refuses_forced_graphs(tower):
    with pytest.raises(UsageError, match="CUDA graphs need a CUDA device"):
        Engine(tower, cuda_graphs=True)
    assert not Engine(tower).graphs_enabled


def test_engine_submit_collect_in_order(tower):
    engine = Engine(tower, out_dtype=torch.float16)
    groups = [GRIDS[:2], GRIDS[2:4], GRIDS[4:]]
    batches = [pack(_items(g, tower.cfg, seed=i), 3) for i, g in enumerate(groups)]
    outs = list(engine.encode_many(batches))
    for i, (g, out) in enumerate(zip(groups, outs)):
        expected = packed_forward(tower, _items(g, tower.cfg, seed=i))
        assert [o.shape for o in out] == [e.shape for e in expected]
        assert all(o.dtype == torch.float16 for o in out)
        assert rel_err(torch.cat(out), torch.cat(expected)) < 1e-3
    assert engine.stats.batches == 3 and engine.pending == 0
    assert engine.stats.real_tokens == sum(h * w for h, w in GRIDS)
    engine.submit(batches[0])
    with pytest.raises(RuntimeError):
        engine.encode(batches[1])


# ----------------------------------------------------------------------------- CUDA graphs

cuda = needs_cuda


@cuda
@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_graphs_equal_eager_on_cuda(features):
    cfg = load_config("tiny")
    model = build_tower(random_checkpoint(cfg, seed=3, dtype=torch.bfloat16), "cuda")
    # deterministic=False: the multi-budget path (the invariant one has one bucket, below).
    graphs = Engine(model, features, cuda_graphs=True, batch_tokens=512, max_images=8,
                    min_budget=64, deterministic=False)
    if not graphs.graphs_enabled:
        pytest.skip(f"no graph-capable attention backend ({graphs.attention_name})")
    eager = Engine(model, features, attention=graphs.attention_name, cuda_graphs=False)
    groups = [GRIDS[:3], GRIDS[3:], [(20, 20)], GRIDS]  # (20, 20): 400 tokens
    batches = [pack(_items(g, cfg, seed=i), 3, features) for i, g in enumerate(groups)]
    for got, want in zip(graphs.encode_many(batches), (eager.encode(b) for b in batches)):
        assert rel_err(torch.cat(got), torch.cat(want)) < 1e-2
    assert graphs.stats.graph_batches == len(batches)
    assert graphs.stats.padded_tokens > 0
    # Larger than every budget: runs eagerly, same numbers.
    big = pack(_items([(24, 24)], cfg, seed=9), 3, features)
    assert rel_err(torch.cat(graphs.encode(big)), torch.cat(eager.encode(big))) < 1e-2
    assert graphs.stats.graph_batches == len(batches)
    # The batch-invariant engine's one bucket holds any single image, even one over the
    # token budget: it replays the graph.
    invariant = Engine(model, features, cuda_graphs=True, batch_tokens=512, max_images=8)
    assert rel_err(torch.cat(invariant.encode(big)), torch.cat(eager.encode(big))) < 1e-2
    assert (invariant.stats.graph_batches, invariant.stats.variant_batches) == (1, 0)
