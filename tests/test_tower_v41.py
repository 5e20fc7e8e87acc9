"""DeepSeek-V4.1-Flash (``model_type`` ``deepseek_v41``): its own image geometry, picked from
config.json in either layout, end to end through the CLI, a saved checkpoint and the Hub.

The grids are checked against a reference written here from the equations of the V4.1
processor (SPEC §4, V4.1 paragraph, and the issue listing the five differences from V4), not
from dsv4enc's code; the reference itself is first checked against published values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from dsv4enc.tower.checkpoint import (INDEX_NAME, load_checkpoint, random_state_dict,
                                save_checkpoint)
from dsv4enc.cli import app
from dsv4enc.tower.config import VisionConfig
from dsv4enc.errors import ConfigError
from dsv4enc.tower.transform import (NORMALIZED_BF16_BITS, image_to_patch_bits, max_image_tokens,
                               plan_canvas)

from helpers import (CONFIGS, decoy_tensors, load_config, nested_layout, record_hub_downloads,
                     table_rows, write_checkpoint, write_image)

runner = CliRunner()

V41_BUDGET, V41_MIN_PIXELS = 1024, 544 * 544


# --------------------------------------------------------------------------- the reference

def ref_v41_canvas(width: int, height: int, p: int = 14, r: int = 3, max_n: int = V41_BUDGET,
                   min_pixels: int = V41_MIN_PIXELS) -> tuple[int, int] | None:
    """(height, width) in pixels of the V4.1 canvas of an image, or None where the V4.1
    processor's final check (the solved canvas must fit the budget) would fail.

    From the equations: upscale small images to min_pixels (no aspect clamp: max_wh_ratio is
    None); round up to whole patches; count rows*(cols+1)+2 LLM tokens; when over the FULL
    budget, solve once for the largest aspect-preserving grid (one column of (max_n-2)//2
    cells when under one cell wide, one row of max_n-3 cells when under one cell high, no
    even-row forcing) and then require that it fits.
    """

    def llm_tokens(canvas_h: int, canvas_w: int) -> int:
        rows = -(-(canvas_h // p) // r)
        cols = -(-(canvas_w // p) // r)
        return rows * (cols + 1) + 2

    w, h = width, height
    if 0 < w * h < min_pixels:
        grow = math.sqrt(min_pixels / (w * h))
        w, h = int(w * grow), int(h * grow)
    canvas_h, canvas_w = -(-h // p) * p, -(-w // p) * p
    if llm_tokens(canvas_h, canvas_w) <= max_n:
        return canvas_h, canvas_w
    cell = p * r
    aspect = h / w
    cols_f = math.sqrt((max_n - 2) / aspect + 0.25) - 0.5  # cols_f*(cols_f+1)*aspect = max_n-2
    rows_f = cols_f * aspect
    if cols_f < 1:
        canvas_h, canvas_w = (max_n - 2) // 2 * cell, cell
    elif rows_f < 1:
        canvas_h, canvas_w = cell, (max_n - 3) * cell
    else:
        beta = min(math.floor(cols_f) * cell / w, math.floor(rows_f) * cell / h)
        canvas_h, canvas_w = math.floor(h * beta / p) * p, math.floor(w * beta / p) * p
    if canvas_h <= 0 or canvas_w <= 0 or llm_tokens(canvas_h, canvas_w) > max_n:
        return None
    return canvas_h, canvas_w


def ref_v41_grid(width: int, height: int, **kw) -> tuple[int, int] | None:
    """(n_h, n_w) ViT patch grid of the reference, or None."""
    p = kw.get("p", 14)
    canvas = ref_v41_canvas(width, height, **kw)
    return None if canvas is None else (canvas[0] // p, canvas[1] // p)


def ref_llm_tokens(n_h: int, n_w: int, r: int = 3) -> int:
    return -(-n_h // r) * (-(-n_w // r) + 1) + 2


# The table: image -> (V4 ViT grid, V4.1 ViT grid), as n_h x n_w.
PUBLISHED = {
    (1024, 768): ((47, 63), (55, 74)),
    (1920, 1080): ((42, 74), (69, 122)),
    (2000, 100): ((10, 78), (9, 174)),
}

# ViT grids (n_h, n_w) recorded by running the checkpoint's own inference/image_processor.py
# (smg PR 2526: deepseek_v41.rs tests and deepseek_v41_preprocess_fingerprints.json).
RECORDED_V41 = {
    (64, 48): (34, 45), (100, 100): (39, 39), (640, 480): (35, 46), (1024, 768): (55, 74),
    (1024, 1024): (74, 74), (1920, 1080): (69, 122), (4000, 4000): (93, 93),
    (4000, 3000): (81, 108), (8000, 1000): (33, 264), (50, 900): (165, 10),
    (1024, 701): (51, 74), (450, 308): (33, 47),
}

# Sizes the implementation must get right: tiny, huge, extreme aspect ratios both ways,
# budgets just met and just exceeded (wide, tall and square), and the min-pixels edge.
TABLE = [
    (1, 1), (1, 2), (3, 2), (14, 14), (13, 15), (41, 43),
    (20000, 15000), (65535, 65535), (100000, 80000), (12345, 67890),
    (1, 50000), (50000, 1), (3, 40000), (40000, 3), (100000, 7), (7, 100000),
    (100, 2000), (1000000, 2), (2, 1000000), (3000, 200), (200, 3000),
    (3024, 588), (3025, 588), (3024, 589), (42, 21462), (42, 21463), (43, 21462),
    (1302, 1302), (1303, 1303), (1302, 1303),
    (543, 543), (544, 544), (545, 545), (546, 546), (544, 545), (272, 1088), (1088, 272),
    *PUBLISHED, *RECORDED_V41,
]


@pytest.fixture(scope="module")
def v41() -> VisionConfig:
    return load_config("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def v4() -> VisionConfig:
    return load_config("deepseek-v4-flash")


# --------------------------------------------------------------------------- the reference, checked

def test_reference_reproduces_published_and_recorded_grids():
    for size, (_, grid) in PUBLISHED.items():
        assert ref_v41_grid(*size) == grid, size
    for size, grid in RECORDED_V41.items():
        assert ref_v41_grid(*size) == grid, size
    # Recorded LLM grids of the extreme strips: one column of 511, one row of 1021 tokens.
    tall, wide = ref_v41_grid(2, 1_000_000), ref_v41_grid(1_000_000, 2)
    assert (-(-tall[0] // 3), -(-tall[1] // 3)) == (511, 1)
    assert (-(-wide[0] // 3), -(-wide[1] // 3)) == (1, 1021)
    assert ref_llm_tokens(*tall) == ref_llm_tokens(*wide) == V41_BUDGET


def test_table_covers_the_budget_edges():
    """The table's edge cases are what they claim to be (checked on the reference)."""
    assert ref_llm_tokens(588 // 14, 3024 // 14) == V41_BUDGET  # fits as is
    assert ref_llm_tokens(588 // 14, -(-3025 // 14)) > V41_BUDGET  # one pixel more: solved
    assert ref_llm_tokens(21462 // 14, 3) == V41_BUDGET
    assert ref_llm_tokens(-(-21463 // 14), 3) > V41_BUDGET
    assert ref_llm_tokens(93, 93) == 994 and ref_llm_tokens(94, 94) > V41_BUDGET
    assert ref_v41_grid(3024, 588) == (42, 216) and ref_v41_grid(42, 21462) == (1533, 3)
    assert ref_v41_grid(544, 544) == ref_v41_grid(546, 546) == (39, 39)  # 544² = min_pixels


# --------------------------------------------------------------------------- the implementation

@pytest.mark.parametrize("size", TABLE, ids=lambda s: f"{s[0]}x{s[1]}")
def test_v41_grid_matches_reference(v41, size):
    canvas = plan_canvas(*size, v41)
    assert (canvas.n_h, canvas.n_w) == ref_v41_grid(*size)
    assert (canvas.height, canvas.width) == ref_v41_canvas(*size)
    assert not canvas.stretch  # no max_wh_ratio: always padded
    assert ref_llm_tokens(canvas.n_h, canvas.n_w) <= V41_BUDGET


def test_published_table_both_variants(v4, v41):
    for size, (grid_v4, grid_v41) in PUBLISHED.items():
        a, b = plan_canvas(*size, v4), plan_canvas(*size, v41)
        assert (a.n_h, a.n_w) == grid_v4, size
        assert (b.n_h, b.n_w) == grid_v41, size


@settings(max_examples=400, deadline=None)
@given(width=st.integers(1, 200_000), height=st.integers(1, 200_000))
def test_v41_grid_matches_reference_sweep(v41, width, height):
    canvas = plan_canvas(width, height, v41)
    assert (canvas.n_h, canvas.n_w) == ref_v41_grid(width, height)


@settings(max_examples=400, deadline=None)
@given(width=st.integers(1, 30_000), height=st.integers(1, 30_000),
       max_n=st.integers(6, 3000), min_pixels=st.sampled_from([0, 1, 3136, 147456, 295936]),
       p=st.sampled_from([14, 16]), r=st.sampled_from([2, 3]))
def test_v41_other_settings_match_reference(v41, width, height, max_n, min_pixels, p, r):
    cfg = dataclasses.replace(v41, max_n_token=max_n, min_pixels=min_pixels, patch_size=p,
                              downsample_ratio=r)
    expected = ref_v41_canvas(width, height, p=p, r=r, max_n=max_n, min_pixels=min_pixels)
    if expected is None:  # the reference's own check fails: an error row, not a wrong grid
        with pytest.raises(ValueError):
            plan_canvas(width, height, cfg)
        return
    canvas = plan_canvas(width, height, cfg)
    assert (canvas.height, canvas.width) == expected
    assert ref_llm_tokens(canvas.n_h, canvas.n_w, r) <= max_n


def test_v41_grid_matches_reference_random_sizes(v41):
    """Log-uniform sizes from 1 to 10^5 pixels a side, seeded."""
    rng = np.random.default_rng(41)
    sizes = np.exp(rng.uniform(0, math.log(1e5), size=(20000, 2))).astype(int)
    for width, height in sizes.tolist():
        canvas = plan_canvas(width, height, v41)
        assert (canvas.n_h, canvas.n_w) == ref_v41_grid(width, height), (width, height)


def test_geometry_follows_model_type_not_numbers(v41):
    """V4's solver with V4.1's numbers is not V4.1: the variant comes from model_type."""
    as_v4 = dataclasses.replace(v41, model_type="deepseek_v4")
    for size in ((4000, 3000), (3024, 588), (1_000_000, 2), (2, 1_000_000)):
        a, b = plan_canvas(*size, as_v4), plan_canvas(*size, v41)
        assert (b.n_h, b.n_w) == ref_v41_grid(*size)
        assert (a.n_h, a.n_w) != (b.n_h, b.n_w), size


def test_max_image_tokens_bounds_and_is_reached(v41):
    bound = max_image_tokens(v41)
    assert bound == 9 * (V41_BUDGET - 3)
    assert plan_canvas(1_000_000, 2, v41).n_patches == bound  # one row of 1021 cells
    for size in TABLE:
        assert plan_canvas(*size, v41).n_patches <= bound


# --------------------------------------------------------------------------- pixels

def seeded_image(width: int, height: int, seed: int) -> Image.Image:
    """The seeded pattern of the recorded fingerprints below."""
    y, x = np.mgrid[0:height, 0:width].astype(np.uint32)
    rgb = np.stack([(x * 7 + y * 3) % 256, (x * 5 + y * 11) % 256, (x + y * 2) % 256], -1)
    return Image.fromarray(((rgb + seed) % 256).astype(np.uint8), "RGB")


def fnv1a_64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@pytest.mark.parametrize("width, height, seed, fingerprint", [
    (64, 48, 0, "15f8a6c52b8c7031"),
    (50, 900, 31, "f59246454f479f80"),
])
def test_patches_match_recorded_reference_fingerprints(v41, width, height, seed, fingerprint):
    """FNV-1a of the bf16 patch bits that the checkpoint's image_processor.py produced for a
    seeded image (smg PR 2526, deepseek_v41_preprocess_fingerprints.json): bit for bit."""
    bits, canvas = image_to_patch_bits(seeded_image(width, height, seed), v41)
    assert (canvas.n_h, canvas.n_w) == RECORDED_V41[(width, height)]
    assert fnv1a_64(bits.astype("<u2").tobytes()) == fingerprint


def test_wide_images_are_padded_gray_not_stretched(v4, v41):
    banner = Image.new("RGB", (2000, 100), (255, 255, 255))
    bits, canvas = image_to_patch_bits(banner, v41)
    assert not canvas.stretch
    # Back to canvas pixels: 2000x100 fits 2436x122 in the 2436x126 canvas, 2 gray rows
    # above and below.
    p = v41.patch_size
    pixels = (bits.reshape(canvas.n_h, canvas.n_w, 3, p, p).transpose(2, 0, 3, 1, 4)
              .reshape(3, canvas.height, canvas.width))
    gray, white = NORMALIZED_BF16_BITS[127], NORMALIZED_BF16_BITS[255]
    assert (canvas.width, canvas.height) == (2436, 126)
    assert (pixels[:, :2] == gray).all() and (pixels[:, -2:] == gray).all()
    assert (pixels[:, 2:-2] == white).all()
    bits_v4, canvas_v4 = image_to_patch_bits(banner, v4)
    assert canvas_v4.stretch and (bits_v4 == NORMALIZED_BF16_BITS[255]).all()


# --------------------------------------------------------------------------- config

def test_v41_config_file(v4, v41):
    assert v41.is_v41 and v41.model_type == "deepseek_v41" and v41.model_name == "DeepSeek-V4.1"
    assert (v41.max_n_token, v41.min_pixels, v41.max_wh_ratio, v41.hidden_size) == (
        1024, 295936, None, 5120)
    tower = ("n_layers", "dim", "n_heads", "inter_dim", "patch_size", "rope_theta",
             "downsample_ratio")
    assert all(getattr(v41, f) == getattr(v4, f) for f in tower)
    assert not v4.is_v41 and v4.model_type == "deepseek_v4"


def test_model_type_detected_in_both_layouts(v41):
    flat = json.loads((CONFIGS / "deepseek-v4.1-flash.json").read_text())
    nested = nested_layout(flat)  # top-level model_type, vision_config, text_config
    assert nested["model_type"] == "deepseek_v41" and "vision_config" in nested
    assert VisionConfig.from_dict(nested) == v41
    # A converted checkpoint naming the variant only in its sub-configs.
    del nested["model_type"]
    nested["vision_config"]["model_type"] = "deepseek_v41_vision"
    assert VisionConfig.from_dict(nested).is_v41
    nested["vision_config"].pop("model_type")
    assert not VisionConfig.from_dict(nested).is_v41  # no model_type anywhere: V4
    for model_type, is_v41 in (("deepseek_v4", False), ("deepseek_v41", True),
                               ("deepseek_v41_text", True), ("deepseek_v4_vision", False)):
        assert VisionConfig.from_dict({**flat, "model_type": model_type}).is_v41 is is_v41
    flat.pop("model_type")
    assert not VisionConfig.from_dict(flat).is_v41


def test_model_type_round_trips_through_to_flat(v41):
    flat = v41.to_flat()
    assert flat["model_type"] == "deepseek_v41"
    assert VisionConfig.from_dict(json.loads(json.dumps(flat))) == v41
    with pytest.raises(ConfigError, match="model_type"):
        dataclasses.replace(v41, model_type="llama")


# --------------------------------------------------------------------------- end to end

IMAGES = [("photo.jpg", (1024, 768), "RGB"), ("banner.png", (2000, 100), "RGB"),
          ("small.png", (64, 48), "RGBA"), ("tall.png", (30, 5000), "L")]


@pytest.fixture(scope="module")
def v41_images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("v41_images")
    for name, size, mode in IMAGES:
        write_image(folder / name, size, mode)
    return folder


def encode(images: Path, out: Path, *args: str) -> list[dict]:
    result = runner.invoke(app, ["encode", str(images), "--out", str(out), "--workers", "0",
                                 "--device", "cpu", "-q", *args])
    assert result.exit_code == 0, result.output
    return table_rows(pq.read_table(out))


def check_v41_output(rows: list[dict], out: Path, cfg: VisionConfig) -> None:
    sizes = {name: size for name, size, _ in IMAGES}
    assert sorted(r["path"] for r in rows) == sorted(sizes)
    for row in rows:
        assert row["error"] is None, row
        assert (row["vit_h"], row["vit_w"]) == ref_v41_grid(*sizes[row["path"]]), row["path"]
        assert (row["grid_h"], row["grid_w"]) == (-(-row["vit_h"] // 3), -(-row["vit_w"] // 3))
        assert len(row["embedding"]) == row["grid_h"] * row["grid_w"]
        assert len(row["embedding"][0]) == cfg.hidden_size
    meta = json.loads(pq.read_schema(out).metadata[b"dsv4enc"])
    assert meta["config"]["model_type"] == "deepseek_v41"
    assert VisionConfig.from_dict(meta["config"]) == cfg
    shown = runner.invoke(app, ["inspect", str(out)], terminal_width=200)
    assert shown.exit_code == 0 and "DeepSeek-V4.1 (deepseek_v41)" in shown.output
    as_json = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)
    assert as_json["model"] == "DeepSeek-V4.1 (deepseek_v41)"


def test_cli_random_init_and_saved_checkpoints(v41_images, tmp_path):
    """--random-init with the tiny V4.1 config, then the same weights saved as a checkpoint
    with model_type deepseek_v41 in config.json, flat and nested: same grids, same values."""
    cfg = VisionConfig.from_file(CONFIGS / "tiny-v41.json")
    assert cfg.is_v41
    rows = {"random": encode(v41_images, tmp_path / "random.parquet", "--config",
                             str(CONFIGS / "tiny-v41.json"), "--random-init", "--seed", "7")}
    check_v41_output(rows["random"], tmp_path / "random.parquet", cfg)

    state = random_state_dict(cfg, seed=7)
    save_checkpoint(tmp_path / "flat", cfg, state)
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["model_type"] == (
        "deepseek_v41")
    write_checkpoint(tmp_path / "nested", nested_layout(cfg.to_flat()),
                     {"model.safetensors": state}, index=False)
    for layout in ("flat", "nested"):
        out = tmp_path / f"{layout}.parquet"
        rows[layout] = encode(v41_images, out, "--weights", str(tmp_path / layout))
        check_v41_output(rows[layout], out, cfg)
    by_path = {name: {r["path"]: r for r in found} for name, found in rows.items()}
    for path in by_path["random"]:
        expected = np.asarray(by_path["random"][path]["embedding"], dtype=np.float32)
        for layout in ("flat", "nested"):
            got = np.asarray(by_path[layout][path]["embedding"], dtype=np.float32)
            np.testing.assert_array_equal(got, expected)  # same weights, same bits


def test_hub_id_fetches_only_tower_shards_of_a_v41_checkpoint(tmp_path, monkeypatch):
    """A V4.1 repository in the real checkpoint's nested layout, from an offline Hub cache:
    config.json, the index and the tower's shards are read, the decoy-only shard never."""
    hf = pytest.importorskip("huggingface_hub")
    from dsv4enc.tower import hub

    cfg = VisionConfig.from_file(CONFIGS / "tiny-v41.json")
    state = random_state_dict(cfg, seed=3)
    names, decoys = sorted(state), sorted(decoy_tensors().items())
    shards = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    decoy_only = "model-00003-of-00003.safetensors"
    config = nested_layout(cfg.to_flat())
    config["architectures"] = ["DeepseekV41ForCausalLM"]
    source = write_checkpoint(tmp_path / "source", config, {
        shards[0]: {**{n: state[n] for n in names[0::2]}, **dict(decoys[0::2])},
        shards[1]: {**{n: state[n] for n in names[1::2]}, **dict(decoys[1::2])},
        decoy_only: {f"layers.1.{n}": t for n, t in decoys},
    })
    repo_id, revision = "deepseek-ai/DeepSeek-V4.1-Flash", "41" * 20
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("config.json", INDEX_NAME, *shards):
        shutil.copy(source / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    requested = record_hub_downloads(hf, monkeypatch)
    folder = hub.resolve_weights(repo_id)
    assert requested == ["config.json", INDEX_NAME, *shards]
    ckpt = load_checkpoint(folder)
    assert ckpt.config == cfg and ckpt.config.is_v41
    assert ckpt.fingerprint == load_checkpoint(source).fingerprint
    assert set(ckpt.state_dict) == set(state)
    assert torch.equal(ckpt.state_dict[names[0]], state[names[0]].float())


def test_extract_keeps_the_variant(tmp_path):
    """``dsv4enc extract`` of a nested V4.1 checkpoint writes a flat config that still says
    deepseek_v41."""
    from dsv4enc.tower.export import extract_tower

    cfg = VisionConfig.from_file(CONFIGS / "tiny-v41.json")
    source = write_checkpoint(tmp_path / "nested", nested_layout(cfg.to_flat()),
                              {"model.safetensors": random_state_dict(cfg, seed=1)}, index=False)
    extract_tower(source, tmp_path / "vision")
    written = json.loads((tmp_path / "vision" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v41" and "vision_config" not in written
    assert load_checkpoint(tmp_path / "vision").config == cfg


def test_help_names_both_variants():
    shown = runner.invoke(app, ["encode", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    assert "deepseek_v41" in shown.output and "deepseek_v4 " in shown.output
    assert "V4.1" in runner.invoke(app, ["--help"], terminal_width=200).output
