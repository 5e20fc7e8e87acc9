"""The fused (compiled) elementwise path against the eager reference, on the CPU (inductor's
C++ backend). Compiling takes a while on a small machine, so one module-scoped tower serves
every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.engine.engine import Engine
from dsv4enc.tower.fusion import fuse_elementwise
from dsv4enc.engine.packing import pack

from helpers import load_config, needs_cuda, random_patch_items, rel_err

GRIDS = [(5, 7), (3, 3), (10, 4), (2, 9), (7, 7)]


@pytest.fixture(scope="module")
def towers():
    cfg = load_config("tiny")
    state = random_checkpoint(cfg, seed=2, dtype=torch.float32)
    return build_tower(state), fuse_elementwise(build_tower(state))


@pytest.mark.slow
@pytest.mark.parametrize("features", ["aligner", "vit"])
def test_fused_equals_eager_to_float_rounding(towers, features):
    eager, fused = towers
    items = random_patch_items(GRIDS, eager.cfg.patch_dim)
    for deterministic in (False, True):
        want = Engine(eager, features, deterministic=deterministic).encode(pack(items, 3, features))
        got = Engine(fused, features, deterministic=deterministic).encode(pack(items, 3, features))
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-6  # float32: only the rounding of fused intermediates


@pytest.mark.slow
def test_fused_rows_stay_batch_invariant(towers):
    _, fused = towers
    items = random_patch_items(GRIDS, fused.cfg.patch_dim, seed=1)
    engine = Engine(fused)
    alone = engine.encode(pack(items[:1], 3))[0]
    mixed = engine.encode(pack(items[2:] + items[:1], 3))[-1]
    assert torch.equal(alone, mixed)


def test_fused_functions_are_installed_on_every_block(towers):
    eager, fused = towers
    assert all(b.mlp.act_fn is not eager.vision.blocks[0].mlp.act_fn for b in fused.vision.blocks)
    assert fused.vision.norm.norm_fn is fused.vision.blocks[0].norm1.norm_fn


def test_kernels_are_specialized_only_where_every_batch_has_one_shape():
    from types import SimpleNamespace

    from dsv4enc.engine.engine import runs_one_shape

    def tower(device: str, tensor_parallel: bool = False):
        return SimpleNamespace(device=torch.device(device), tensor_parallel=tensor_parallel)

    # The batch-invariant CUDA engine: one bucket shape, so fuse_elementwise specializes.
    assert runs_one_shape(tower("cuda"), deterministic=True)
    # CPU (each image at its own shape, which must not get a different kernel by the order
    # shapes arrive in), --no-deterministic, tensor parallelism: shape-generic kernels.
    assert not runs_one_shape(tower("cpu"), deterministic=True)
    assert not runs_one_shape(tower("cuda"), deterministic=False)
    assert not runs_one_shape(tower("cuda", tensor_parallel=True), deterministic=True)


@pytest.mark.slow
def test_encode_fused_rows_equal_eager_rows_to_float_rounding(tmp_path):
    """``dsv4enc encode --fused`` as a user runs it (the pipeline installs the kernels)."""
    import numpy as np
    from typer.testing import CliRunner

    from dsv4enc.cli import app
    from dsv4enc.output.read import read_embeddings
    from helpers import CONFIGS, write_image

    images = tmp_path / "images"
    images.mkdir()
    for i, size in enumerate([(64, 48), (90, 120), (200, 60)]):
        write_image(images / f"{i}.png", size, seed=i)

    def run(out: Path, *extra: str):
        return CliRunner().invoke(app, [
            "encode", str(images), "--out", str(out), "--config", str(CONFIGS / "tiny.json"),
            "--random-init", "--device", "cpu", "--dtype", "float32", "--out-dtype", "float32",
            "--workers", "0", "-q", *extra])

    def encode(out: Path, *extra: str) -> dict:
        result = run(out, *extra)
        assert result.exit_code == 0, result.output
        return {path: emb for path, emb, _ in read_embeddings(out)}

    eager = encode(tmp_path / "eager.parquet")
    fused = encode(tmp_path / "fused.parquet", "--fused")
    assert sorted(eager) == sorted(fused) and len(eager) == 3
    for path, want in eager.items():
        got = fused[path]
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)
    # Not bytes alike: an update never mixes rows of both (the output records which made it).
    write_image(images / "3.png", (40, 40), seed=3)
    for out, other in ((tmp_path / "eager.parquet", "--fused"),
                       (tmp_path / "fused.parquet", "--no-fused")):
        refused = run(out, "--update", other)
        assert refused.exit_code == 2 and "fused kernels" in refused.output, refused.output


def test_the_vector_width_follows_a_capped_aten_level(monkeypatch):
    """Under ATEN_CPU_CAPABILITY inductor is told the capped level's vector width (its own
    choice gave NaN from shape-generic kernels there); without the cap, or with a width set
    already, nothing changes."""
    from torch._inductor import config

    from dsv4enc.tower.fusion import SIMD_BITS, pin_cpu_vector_width

    # config.patch, not monkeypatch: monkeypatch's undo deletes an inductor setting for good
    # (the config's proxy reads a restored attribute as a deleted one), which broke every
    # later compile in the session.
    with config.patch({"cpp.simdlen": None}):
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        pin_cpu_vector_width()
        assert config.cpp.simdlen is None
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        pin_cpu_vector_width()
        assert config.cpp.simdlen == SIMD_BITS["AVX2"] == 256
        config.cpp.simdlen = 128
        pin_cpu_vector_width()
        assert config.cpp.simdlen == 128


def test_fused_is_the_default_on_cuda_and_not_on_the_cpu():
    """``--fused`` unset follows the device; ``--fused``/``--no-fused`` force it."""
    from dsv4enc.engine.defaults import resolve_fused

    assert resolve_fused(None, "cuda") and not resolve_fused(None, "cpu")
    assert resolve_fused(True, "cpu") and not resolve_fused(False, "cuda")


def test_an_unset_fused_builds_the_eager_tower_on_the_cpu():
    from dsv4enc.engine.factory import build_model
    from dsv4enc.tower.model import swiglu

    state = random_checkpoint(load_config("tiny"), seed=2, dtype=torch.float32)
    model = build_model(state, torch.device("cpu"))
    assert all(b.mlp.act_fn is swiglu for b in model.vision.blocks)


@needs_cuda
@pytest.mark.slow
def test_the_default_cuda_tower_is_fused_batch_invariant_and_near_eager():
    from dsv4enc.engine.factory import build_engine

    state = random_checkpoint(load_config("tiny"), seed=2, dtype=torch.bfloat16)
    cuda = torch.device("cuda")
    fused = build_engine(state, cuda)  # the default: fused on CUDA
    eager = build_engine(state, cuda, fused=False)
    assert fused.model.vision.blocks[0].mlp.act_fn is not eager.model.vision.blocks[0].mlp.act_fn
    items = random_patch_items(GRIDS, fused.cfg.patch_dim, seed=1)
    got = fused.encode(pack(items, 3))
    want = eager.encode(pack(items, 3))
    assert all(rel_err(g, w) < 2e-2 for g, w in zip(got, want))
    assert torch.equal(fused.encode(pack(items[:1], 3))[0], got[0])


def test_the_vector_isa_probe_runs_once_per_cache_folder(tmp_path, monkeypatch):
    """Inductor's probe of the CPU's vector ISAs runs where the folder has no record of it;
    with the record, ``cpp.vec_isa_ok`` is set without probing. A user's setting, or another
    device, is left alone."""
    import torch._inductor.cpu_vec_isa as cpu_vec_isa
    from torch._inductor import config

    from dsv4enc.tower.fusion import trust_vector_isas

    cpu = torch.device("cpu")
    with config.patch({"cpp.vec_isa_ok": None}):
        trust_vector_isas(tmp_path, torch.device("meta"))
        assert config.cpp.vec_isa_ok is None and not list(tmp_path.iterdir())
        trust_vector_isas(tmp_path, cpu)
        if not list(tmp_path.iterdir()):  # an ISA this CPU reports failed inductor's probe
            assert config.cpp.vec_isa_ok is None
            return
        assert config.cpp.vec_isa_ok is True
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: pytest.fail("probed"))
    with config.patch({"cpp.vec_isa_ok": None}):
        trust_vector_isas(tmp_path, cpu)
        assert config.cpp.vec_isa_ok is True
    with config.patch({"cpp.vec_isa_ok": False}):
        trust_vector_isas(tmp_path, cpu)
        assert config.cpp.vec_isa_ok is False
