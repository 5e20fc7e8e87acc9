"""Batch invariance: an image's output bytes do not depend on the batch it shares.

These tests compare with ``torch.equal``: the engine guarantees bit-identical rows for one
image whatever else is packed with it (``Engine(deterministic=True)``, the default), so no
tolerance is owed. Images of more than ``ROW_TILE`` patches are included, so chunk edges
alone and inside batches of other sizes are exercised.
"""

from __future__ import annotations

import pytest
import torch

from dsv4enc.checkpoint import build_tower, random_checkpoint
from dsv4enc.config import VisionConfig
from dsv4enc.engine import Engine
from dsv4enc.model import rope_tables
from dsv4enc.model import image_spans
from dsv4enc.packing import pack

#: Wide enough that GEMM kernels pick different blockings for different row counts.
CFG = VisionConfig(n_layers=2, dim=128, n_heads=4, inter_dim=352, patch_size=14,
                   rope_theta=10000.0, downsample_ratio=3, max_n_token=384,
                   min_pixels=147456, max_wh_ratio=8, hidden_size=192)

#: 1x3: alone, its GEMMs have 3 rows, which BLAS libraries serve with other kernels than
#: large ones (on AVX2 CPUs the plain packed forward gives it other bits in a large batch).
TARGETS = [(23, 17), (1, 3)]
OTHERS = [(5, 7), (31, 30), (1, 1), (12, 40), (9, 9), (40, 12), (3, 50)]


def _patches(grid, seed):
    gen = torch.Generator().manual_seed(seed)
    h, w = grid
    return (torch.randn(h * w, CFG.patch_dim, generator=gen).to(torch.bfloat16), h, w)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def tower(request):
    return build_tower(random_checkpoint(CFG, seed=3, dtype=request.param))


def _batches(grid):
    """The target alone, then in three mixed batches: first, last and in the middle, with
    other sizes and orders."""
    target = _patches(grid, 0)
    others = [_patches(g, i + 1) for i, g in enumerate(OTHERS)]
    return [
        ([target], 0),
        ([target] + others[:3], 0),
        (others[3:] + [target], len(others[3:])),
        (others[5:7] + [target] + others[:2], 2),
    ]


@pytest.mark.parametrize("grid", TARGETS, ids=["large", "tiny"])
@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_image_bytes_do_not_depend_on_its_batch(tower, features, grid):
    outs = []
    for items, at in _batches(grid):
        engine = Engine(tower, features, out_dtype=torch.float32)
        outs.append(engine.encode(pack(items, CFG.downsample_ratio, features))[at])
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


def test_rope_tables_do_not_depend_on_the_batch():
    small = torch.tensor([[3, 4], [0, 1]], dtype=torch.int32)
    large = torch.cat([small, torch.tensor([[2000, 1500]], dtype=torch.int32)])
    cos_s, sin_s = rope_tables(small, CFG)
    cos_l, sin_l = rope_tables(large, CFG)
    assert torch.equal(cos_s, cos_l[:2]) and torch.equal(sin_s, sin_l[:2])


def test_image_spans_skip_empty_images():
    assert image_spans([5, 0, 3]) == [(0, 5), (5, 8)]
    assert image_spans([]) == []
