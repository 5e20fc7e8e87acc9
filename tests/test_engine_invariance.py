"""Batch invariance: an image's output bytes do not depend on the batch it shares.

These tests compare with ``torch.equal``: the engine guarantees bit-identical rows for one
image whatever else is packed with it (``Engine(deterministic=True)``, the default), so no
tolerance is owed. Images of more than ``ROW_TILE`` patches are included, so chunk edges
alone and inside batches of other sizes are exercised.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from dsv4enc import Encoder
from dsv4enc.cli import app

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.engine import Engine
from dsv4enc.tower.model import rope_tables
from dsv4enc.tower.model import image_spans
from dsv4enc.engine.packing import pack

from helpers import table_rows, write_image

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


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
@pytest.mark.parametrize("grid", TARGETS, ids=["large", "tiny"])
@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_image_bytes_do_not_depend_on_its_batch(tower, features, grid, attention):
    outs = []
    for items, at in _batches(grid) + [([_patches(grid, 0)] * 3 + [_patches((5, 7), 9)], 1)]:
        engine = Engine(tower, features, attention, out_dtype=torch.float32)
        outs.append(engine.encode(pack(items, CFG.downsample_ratio, features))[at])
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_grouped_attention_rows_equal_the_simple_paths_in_one_packed_pass(tower, features):
    """Without the per-image pass, one packed forward: the grouped kernel changes no bit."""
    items = [_patches(g, i) for i, g in enumerate(OTHERS[:3] + OTHERS[:3] + [TARGETS[0]])]
    batch = pack(items, CFG.downsample_ratio, features)
    want = Engine(tower, features, "sdpa", deterministic=False).encode(batch)
    got = Engine(tower, features, "grouped", deterministic=False).encode(batch)
    assert len(got) == len(items) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_rope_tables_do_not_depend_on_the_batch():
    small = torch.tensor([[3, 4], [0, 1]], dtype=torch.int32)
    large = torch.cat([small, torch.tensor([[2000, 1500]], dtype=torch.int32)])
    cos_s, sin_s = rope_tables(small, CFG)
    cos_l, sin_l = rope_tables(large, CFG)
    assert torch.equal(cos_s, cos_l[:2]) and torch.equal(sin_s, sin_l[:2])


def test_image_spans_skip_empty_images():
    assert image_spans([5, 0, 3]) == [(0, 5), (5, 8)]
    assert image_spans([]) == []


# --------------------------------------------------------------------- API and command line

SIZES = {"target.png": (120, 90), "a.jpg": (400, 300), "b.png": (90, 500), "c.jpg": (64, 64),
         "d.webp": (1000, 120), "e.png": (333, 222)}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    return {name: write_image(folder / name, size) for name, size in SIZES.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_api_image_alone_equals_it_in_any_batch_and_any_input_kind(photos, dtype):
    encoder = Encoder.from_config(CFG, seed=4, device="cpu", dtype=dtype)
    target = photos["target.png"]
    others = [p for name, p in photos.items() if name != "target.png"]
    alone = encoder.encode(target)
    data = target.read_bytes()
    with Image.open(target) as image:
        image.load()
        pil = image.copy()
    variants = [
        encoder.encode([target] + others[:2])[0],                  # first, 3 images
        encoder.encode(others + [target])[-1],                     # last, 6 images
        encoder.encode(others[3:] + [target] + others[:1], batch_tokens=2048)[2],
        encoder.encode(data),                                      # bytes
        encoder.encode(pil),                                       # PIL image
        encoder.encode(np.asarray(pil)),                           # uint8 array
        encoder.encode({"bytes": data, "path": "x.png"}),          # datasets' Image dict
    ]
    for got in variants:
        assert torch.equal(got, alone)


def _cli(inputs: list[Path], out: Path, config: Path, dtype: str, *extra: str) -> dict:
    result = CliRunner().invoke(app, [
        "encode", *map(str, inputs), "--out", str(out), "--config", str(config),
        "--random-init", "--seed", "4", "--device", "cpu", "--dtype", dtype,
        "--out-dtype", "float32", "--workers", "0", "-q", *extra])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[b"dsv4enc"])
    assert meta["batch_invariant"] is True and meta["device"] == "cpu"
    assert meta["compute_dtype"] == dtype
    return {r["path"]: r["embedding"] for r in table_rows(table)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_rows_do_not_depend_on_batch_or_container(photos, tmp_path, dtype):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(CFG.to_flat()))
    alone_dir = tmp_path / "alone"
    alone_dir.mkdir()
    shutil.copy(photos["target.png"], alone_dir / "target.png")
    folder = photos["target.png"].parent
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for name, path in photos.items():
            tar.add(path, arcname=name)
    table = tmp_path / "table.parquet"
    pq.write_table(pa.table({"name": list(photos), "image": [p.read_bytes()
                                                             for p in photos.values()]}), table)
    want = _cli([alone_dir], tmp_path / "alone.parquet", config, dtype)["target.png"]
    runs = [
        _cli([folder], tmp_path / "all.parquet", config, dtype)["target.png"],
        _cli([folder], tmp_path / "small.parquet", config, dtype,
             "--batch-tokens", "1500")["target.png"],
        _cli([shard], tmp_path / "tar.parquet", config, dtype)[f"{shard}/target"],
        _cli([table], tmp_path / "cell.parquet", config, dtype,
             "--key-column", "name")["target.png"],
    ]
    for got in runs:
        assert got == want  # float32 values compared exactly
