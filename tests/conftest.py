"""Shared fixtures.

Session-scoped fixtures build their files once per run under pytest's temporary root; treat
everything they return as read-only (copy a checkpoint folder before changing it).

Plain helpers (``rel_err``, ``packed_forward``, ``write_checkpoint``, ...) live in
``tests/helpers.py``: ``from helpers import rel_err``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings

from dsv4enc.tower.checkpoint import (build_tower, random_checkpoint, random_state_dict,
                                save_checkpoint)
from dsv4enc.tower.config import VisionConfig

from helpers import (DECOY_ONLY_FILE, DEFAULT_IMAGES, REPO_ROOT, SHARD_FILES, ImageSpec,
                     decoy_tensors, write_checkpoint, write_image)
from objectstore import s3, s3_outage, s3_server  # noqa: F401  (fixtures: local S3 servers)

# One intra-op thread, as the suite's subprocess runs have (OMP_NUM_THREADS=1): with some
# CPU kernels (MKL's float32 GEMM at AVX2) a row's bytes depend on the thread count, and many
# tests compare a subprocess's rows with an in-process reference bit for bit
# (DSV4ENC_TEST_THREADS overrides).
torch.set_num_threads(int(os.environ.get("DSV4ENC_TEST_THREADS", "1")))

# --dtype auto on the CPU is bfloat16 on some CI machines (AMX) and float32 on others: the
# suite's float32 references hold for float32, so auto means float32 here (subprocesses
# too). test_cpufeatures tests the machine's own decision.
os.environ.setdefault("DSV4ENC_CPU_AUTO_DTYPE", "float32")

# Ray starts its workers at niceness 15 (below the raylet) by default. The suite's local
# Rays (tests/test_ray.py, --engine ray) run theirs at the tests' own priority, so that a
# machine kept busy by other work slows the Ray tests as much as the rest, instead of
# starving their actors (about 1/30 of a core each against one process at niceness 0).
os.environ.setdefault("RAY_worker_niceness", "0")

# No per-example deadline: timings on a loaded CI box are noise, not a property.
settings.register_profile("dsv4enc", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dsv4enc"))

TINY_SEED = 0

# --------------------------------------------------------------------------- golden vectors

@dataclass(frozen=True)
class GoldenCase:
    """One golden image: file, tensor key prefix and expected patch grid."""

    name: str
    path: Path
    key: str
    vit_h: int
    vit_w: int


@dataclass(frozen=True)
class GoldenSet:
    """The golden folder, parsed: checkpoint folder, cases in file-name order, and the
    expected tensors (``KEY.patches`` bf16 (n, 3, p, p); ``KEY.vit``, ``KEY.aligner`` float64)."""

    root: Path
    ckpt: Path
    cases: tuple[GoldenCase, ...]
    tensors: dict[str, torch.Tensor]


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """Path of the golden vectors: ``shared/golden`` beside the repository (override with
    ``DSV4ENC_GOLDEN``). Skips the test when the folder is absent."""
    path = Path(os.environ.get("DSV4ENC_GOLDEN", REPO_ROOT.parent / "shared" / "golden"))
    if not (path / "expected.json").is_file():
        pytest.skip(f"golden vectors not found at {path}")
    return path


@pytest.fixture(scope="session")
def golden(golden_dir: Path) -> GoldenSet:
    """The golden vectors loaded once per session (see ``GoldenSet``)."""
    from safetensors.torch import load_file

    meta = json.loads((golden_dir / "expected.json").read_text())
    cases = tuple(GoldenCase(name, golden_dir / "images" / name, e["key"], e["vit_h"], e["vit_w"])
                  for name, e in sorted(meta.items()))
    tensors = load_file(str(golden_dir / "expected.safetensors"))
    return GoldenSet(golden_dir, golden_dir / "ckpt", cases, tensors)


# --------------------------------------------------------------------------- configs, towers

@pytest.fixture(scope="session")
def tiny_cfg() -> VisionConfig:
    """``configs/tiny.json``: D=32, H=2, I=40, 2 layers, p=14, r=3, hidden 24, real transform."""
    return VisionConfig.from_file(REPO_ROOT / "configs" / "tiny.json")


@pytest.fixture(scope="session")
def small_cfg(tiny_cfg) -> VisionConfig:
    """The tiny tower with a small transform (no upscaling past 56x56 pixels, a 24-token
    budget), so that end-to-end runs stay fast."""
    return replace(tiny_cfg, min_pixels=56 * 56, max_n_token=24)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory, small_cfg) -> Path:
    """A random tower of ``small_cfg`` written as a checkpoint folder (bf16, float32 norms)."""
    from dsv4enc.tower.checkpoint import random_state_dict, save_checkpoint

    folder = tmp_path_factory.mktemp("small_ckpt")
    save_checkpoint(folder, small_cfg, random_state_dict(small_cfg, seed=5))
    return folder


@pytest.fixture(scope="session")
def tiny_state(tiny_cfg: VisionConfig) -> dict[str, torch.Tensor]:
    """Random tiny tower weights as stored (bf16, norm weights float32), seed ``TINY_SEED``.
    Both ``tiny_ckpt`` and ``sharded_ckpt`` hold exactly these tensors."""
    return random_state_dict(tiny_cfg, seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_tower(tiny_cfg: VisionConfig):
    """A float32 random tiny ``VisionTower`` (eval mode, no grad), built in memory."""
    return build_tower(random_checkpoint(tiny_cfg, seed=TINY_SEED, dtype=torch.float32))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_cfg, tiny_state) -> Path:
    """A tiny checkpoint folder in the official format: flat config.json and one
    model.safetensors (no index) holding ``tiny_state`` plus a language-model decoy
    ``embed.weight`` (bf16). Read-only."""
    folder = tmp_path_factory.mktemp("tiny_ckpt")
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(64, tiny_cfg.hidden_size, generator=gen).to(torch.bfloat16)
    decoy = {"embed.weight": embed}
    save_checkpoint(folder, tiny_cfg, tiny_state, extra=decoy)
    return folder


@pytest.fixture(scope="session")
def sharded_ckpt(tmp_path_factory, tiny_cfg, tiny_state) -> Path:
    """A tiny checkpoint with ``model.safetensors.index.json``: the tower split over two
    shards (``helpers.SHARD_FILES``), language-model decoys beside it (bf16, int8 and, where
    torch has it, float8_e4m3fn), and a third shard (``helpers.DECOY_ONLY_FILE``) holding only
    decoys, which a loader must never open. Same tower weights as ``tiny_ckpt``. Read-only."""
    folder = tmp_path_factory.mktemp("sharded_ckpt")
    names = sorted(tiny_state)
    decoys = sorted(decoy_tensors().items())
    files = {
        SHARD_FILES[0]: {**{n: tiny_state[n] for n in names[0::2]}, **dict(decoys[0::2])},
        SHARD_FILES[1]: {**{n: tiny_state[n] for n in names[1::2]}, **dict(decoys[1::2])},
        DECOY_ONLY_FILE: {f"layers.1.{n}": t for n, t in decoys},
    }
    write_checkpoint(folder, tiny_cfg.to_flat(), files, index=True)
    return folder


# --------------------------------------------------------------------------- images

@pytest.fixture
def make_images(tmp_path: Path) -> Callable[..., list[Path]]:
    """Factory writing small images of varied sizes, modes and formats.

    ``make_images(specs=helpers.DEFAULT_IMAGES, folder=tmp_path / "images")`` writes each
    ``(relative path, (width, height), mode)`` spec (sub-folders included) and returns the
    paths in spec order. Pixels are deterministic noise.
    """

    def make(specs: Sequence[ImageSpec] = DEFAULT_IMAGES, folder: Path | None = None) -> list[Path]:
        root = Path(folder) if folder is not None else tmp_path / "images"
        return [write_image(root / rel, size, mode) for rel, size, mode in specs]

    return make
