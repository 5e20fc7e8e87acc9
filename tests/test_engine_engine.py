"""The engine: packed batches in, per-image host tensors out, equal to the per-image forward."""

from __future__ import annotations

import logging

import pyarrow.parquet as pq
import pytest
import torch

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.packing import pack

from helpers import CONFIGS, load_config, needs_cuda, random_patch_items, rel_err

GRIDS = [(5, 7), (3, 3), (10, 4), (1, 1), (2, 9), (7, 7)]
cuda = needs_cuda


def _items(grids, cfg, seed=0):
    return random_patch_items(grids, cfg.patch_dim, seed)


@pytest.fixture(scope="module")
def tower():
    return build_tower(random_checkpoint(load_config("tiny"), seed=5, dtype=torch.float32))


@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_encode_equals_per_image_forward(tower, features):
    items = _items(GRIDS, tower.cfg)
    outs = Engine(tower, features).encode(pack(items, 3, features))
    assert len(outs) == len(items)
    with torch.inference_mode():
        for (patches, h, w), out in zip(items, outs):
            want = tower.forward_image(patches, h, w, features)
            assert out.shape == want.shape and out.device.type == "cpu"
            assert rel_err(out, want) < 1e-5


def test_out_dtype_and_stats(tower):
    engine = Engine(tower, out_dtype=torch.float16)
    batch = pack(_items(GRIDS, tower.cfg), 3)
    outs = engine.encode(batch)
    assert all(o.dtype == torch.float16 for o in outs)
    s = engine.stats
    assert (s.batches, s.real_tokens, s.padded_tokens) == (1, batch.n_tokens, 0)
    assert s.model_s > 0 and s.h2d_s == 0


def test_pipeline_keywords(tower):
    engine = Engine(tower, features="aligner", attention="auto", out_dtype=torch.float32,
                    cuda_graphs=None, batch_tokens=4096, max_images=16)
    assert engine.batch_tokens == 4096 and engine.attention_name == "sdpa"
    assert not engine.graphs_enabled and engine.runner is None
    assert Engine(tower).batch_tokens == 8192  # the CPU default


def test_engines_sharing_a_model_keep_their_backend(tower):
    from dsv4enc.tower.attention import naive_sdpa_attention, sdpa_attention

    engine = Engine(tower)
    tower.attend = naive_sdpa_attention  # as another engine (or the naive benchmark) would
    engine.encode(pack(_items(GRIDS[:2], tower.cfg), 3))
    assert tower.attend is sdpa_attention


# ----------------------------------------------------------------------------- CUDA

@pytest.fixture(scope="module")
def cuda_tower():
    cfg = load_config("tiny")
    return build_tower(random_checkpoint(cfg, seed=5, dtype=torch.bfloat16), "cuda")


@cuda
def test_cuda_defaults_follow_backend_and_dtype(cuda_tower, caplog):
    engine = Engine(cuda_tower)
    assert engine.graphs_enabled == (engine.attention_name in ("flash", "varlen"))
    with caplog.at_level(logging.INFO, logger="dsv4enc.engine.engine"):
        sdpa = Engine(cuda_tower, attention="sdpa", cuda_graphs=True)
    assert not sdpa.graphs_enabled
    assert "CUDA graphs off" in caplog.text
    fp32 = build_tower(random_checkpoint(load_config("tiny"), seed=5, dtype=torch.float32), "cuda")
    engine32 = Engine(fp32)
    assert engine32.attention_name == "sdpa" and not engine32.graphs_enabled


@cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_submit_collect_overlap(cuda_tower, graphs):
    cfg = cuda_tower.cfg
    engine = Engine(cuda_tower, cuda_graphs=graphs, batch_tokens=1024, max_images=8,
                    min_budget=64)
    reference = Engine(cuda_tower, attention="sdpa", cuda_graphs=False)
    groups = [GRIDS[:2], GRIDS[2:], GRIDS, [(12, 12)]]
    batches = [pack(_items(g, cfg, seed=i), 3) for i, g in enumerate(groups)]
    for batch in batches:  # several in flight at once
        engine.submit(batch)
    assert engine.pending == len(batches)
    for batch in batches:
        got = engine.collect()
        assert all(o.is_pinned() and o.dtype == torch.float32 for o in got)
        assert rel_err(torch.cat(got), torch.cat(reference.encode(batch))) < 2e-2
    s = engine.stats
    assert s.batches == len(batches) and s.h2d_s > 0 and s.model_s > 0
    assert s.graph_batches == (len(batches) if engine.graphs_enabled else 0)


# ----------------------------------------------------------------------------- benchmark

def test_image_flops_counts_matmuls_attention_and_aligner():
    from dsv4enc.run.plan import image_flops

    cfg = load_config("deepseek-v4-flash")
    N, D, I = 48 * 64, cfg.dim, cfg.inter_dim
    per_layer = 2 * N * D * (3 * D + D + 3 * I) + 4 * N * N * D
    aligner = 2 * 16 * 22 * (9 * D * cfg.hidden_size + cfg.hidden_size ** 2)
    want = 2 * N * cfg.patch_dim * D + cfg.n_layers * per_layer + aligner
    assert image_flops(cfg, 48, 64) == pytest.approx(want)
    assert image_flops(cfg, 48, 64, "vit") == pytest.approx(want - aligner)


@pytest.mark.slow  # compiles the fused tower
def test_bench_smoke(tmp_path):
    from dsv4enc.bench.throughput import print_results, run_bench

    rows = run_bench(str(CONFIGS / "tiny.json"), device="cpu", dtype="float32",
                     images="synthetic:120x90:3", batch_tokens=[2048], repeat=1,
                     workdir=str(tmp_path), fused=(False, True))
    meta, model, fused, naive = rows
    assert meta["mode"] == "meta" and meta["images"] == 3 and meta["matmul_ceiling"] > 0
    assert model["mode"] == "model" and model["images"] == 3 and model["batches"] >= 1
    assert (model["fused"], fused["fused"], fused["mode"]) == (False, True, "model")
    assert 0 < model["ceiling_frac"] and model["padding"] == 0
    assert naive["mode"] == "naive" and naive["img_s"] > 0
    assert model["vs_naive"] == model["img_s"] / naive["img_s"]
    print_results(rows)


@pytest.mark.slow  # runs the command in a process of its own
def test_bench_end_to_end_rows_in_process_and_as_a_command(tmp_path):
    from dsv4enc.bench.throughput import run_bench

    rows = run_bench(str(CONFIGS / "tiny.json"), device="cpu", dtype="float32",
                     images="synthetic:120x90:3", batch_tokens=[2048], repeat=1, e2e=True,
                     cli=True, workers=1, workdir=str(tmp_path), e2e_outputs=("file", "folder"))
    by_mode = {(r["mode"], r.get("output")): r for r in rows}
    for output in ("file", "folder"):
        assert by_mode["e2e", output]["images"] == 3 and by_mode["e2e", output]["img_s"] > 0
    assert pq.read_table(tmp_path / "bench_parts").num_rows == 3
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["cli"]["images"] == 3 and by_mode["cli"]["seconds"] > 0
    assert pq.read_table(tmp_path / "bench-cli.parquet").num_rows == 3


def test_transform_placement_and_a_bad_choice_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from dsv4enc.cli import app
    from dsv4enc.engine.defaults import transform_on_device

    assert transform_on_device("auto", "cuda") and not transform_on_device("auto", "cpu")
    assert transform_on_device("device", "cpu") and not transform_on_device("host", "cuda")
    result = CliRunner().invoke(app, ["encode", str(tmp_path), "--out", str(tmp_path / "o.parquet"),
                                      "--config", str(CONFIGS / "tiny.json"), "--random-init",
                                      "--transform", "gpu"])
    assert result.exit_code == 2, result.output
    assert "--transform must be one of auto, host, device" in result.output
    assert "Traceback" not in result.output
