"""``dsv4enc encode`` end to end: the Parquet it writes (SPEC §9), the embeddings in it, and
how the command behaves on bad images, bad options, bad weights and existing outputs.

Most runs go through Typer's CliRunner in this process (``--workers 0``: decoding inline),
a few through ``python -m dsv4enc`` in a subprocess. The model is a random tiny tower written
to disk as a real checkpoint (bf16 weights, float32 norms, a language-model decoy), with a
config whose transform keeps images small so that every run takes well under a second.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
from PIL import Image
from typer.testing import CliRunner

import dsv4enc
from dsv4enc.output import parts as writer
from dsv4enc.tower.checkpoint import (Checkpoint, build_tower, load_checkpoint, random_state_dict,
                                save_checkpoint)
from dsv4enc.cli import app
from dsv4enc.tower.config import VisionConfig
from dsv4enc.output.read import embedding_arrays, embedding_format
from dsv4enc.tower.transform import image_to_patches

from helpers import CONFIGS, REPO_ROOT, rel_err, write_image

# (relative path, (width, height), mode) of the good images in the test tree.
GOOD = (
    ("Zebra.PNG", (40, 30), "RGB"),
    ("a.jpg", (64, 48), "RGB"),
    ("b/deep/d.png", (20, 20), "L"),
    ("b/inner.webp", (30, 50), "RGB"),
    ("b-c.gif", (24, 24), "P"),
    ("b.jpg", (120, 90), "RGB"),  # over the token budget: scaled down
    ("x.jpg/y.bmp", (16, 40), "RGB"),  # inside a folder whose name looks like an image
    ("é.png", (25, 25), "RGBA"),
    ("日本.jpeg", (150, 15), "RGB"),  # 10:1, wider than max_wh_ratio: stretched
)
BAD = ("bad/empty.jpg", "bad/gone.png", "bad/noise.png", "bad/trunc.jpg")
NOT_IMAGES = ("notes.txt", "b/readme.md")
# Sorted recursive walk: each folder's entries by name, so component by component.
ORDER = sorted([rel for rel, _, _ in GOOD] + list(BAD), key=lambda k: k.split("/"))
HIDDEN = 24  # aligner width of the tiny config
DIM = 32  # ViT width

runner = CliRunner()


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def cfg(small_cfg) -> VisionConfig:
    return small_cfg


@pytest.fixture(scope="module")
def state(cfg) -> dict[str, torch.Tensor]:
    return random_state_dict(cfg, seed=7)


def decoy() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"embed.weight": torch.randn(50, HIDDEN, generator=gen).to(torch.bfloat16)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, cfg, state) -> Path:
    """One model.safetensors (no index): the tower plus a decoy ``embed.weight``."""
    folder = tmp_path_factory.mktemp("cli_ckpt")
    save_checkpoint(folder, cfg, state, extra=decoy())
    return folder


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, cfg, state) -> Path:
    """The same tower over three shards with model.safetensors.index.json."""
    folder = tmp_path_factory.mktemp("cli_sharded")
    save_checkpoint(folder, cfg, state, extra=decoy(), shards=3)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def reference(cfg, state):
    """The per-image float32 forward of the same weights, built without the loader."""
    full = {n: t.to(torch.float32) for n, t in state.items()}
    tower = build_tower(Checkpoint(cfg, full, "reference", "reference"))

    def forward(path: Path, features: str = "aligner"):
        with Image.open(path) as image:
            patches, canvas = image_to_patches(image, cfg)
        with torch.inference_mode():
            out = tower.forward_image(patches.to(torch.float32), canvas.n_h, canvas.n_w,
                                      features)
        return out, canvas

    return forward


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Images in nested folders with unicode names, broken files and non-images."""
    root = tmp_path_factory.mktemp("cli_images")
    for rel, size, mode in GOOD:
        write_image(root / rel, size, mode)
    rng = np.random.default_rng(11)
    (root / "bad").mkdir()
    (root / "bad" / "empty.jpg").write_bytes(b"")
    (root / "bad" / "noise.png").write_bytes(rng.integers(0, 256, 600, dtype=np.uint8).tobytes())
    whole = write_image(root / "bad" / "whole.jpg", (64, 64)).read_bytes()
    (root / "bad" / "trunc.jpg").write_bytes(whole[: len(whole) // 2])
    (root / "bad" / "whole.jpg").unlink()
    os.symlink(root / "bad" / "no-such-file.png", root / "bad" / "gone.png")
    for rel in NOT_IMAGES:
        (root / rel).write_text("not an image\n")
    return root


def encode(*args: str, env: dict | None = None):
    """Run ``dsv4enc encode`` in-process; DSV4ENC_WEIGHTS unset unless ``env`` sets it."""
    full_env = {"DSV4ENC_WEIGHTS": None, "COLUMNS": "200", **(env or {})}
    # not -q: tests read the summary (stderr is no terminal: no bar; a progress line every 30 s)
    return runner.invoke(app, ["encode", *args, "--device", "cpu", "--workers", "0"],
                         env=full_env)


def one_line_error(result, code: int | None = None) -> str:
    """Assert ``result`` failed with a single stderr line and no traceback; return the line."""
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code, (result.exit_code, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    text = result.stderr.strip()
    assert "Traceback" not in result.output
    assert len(text.splitlines()) == 1, text
    return text


def summary_count(stderr: str, label: str) -> int:
    match = re.search(re.escape(label) + r"\W+(\d+)", stderr)
    assert match, stderr
    return int(match.group(1))


def meta(table_or_schema) -> dict:
    schema = getattr(table_or_schema, "schema", table_or_schema)
    return json.loads(schema.metadata[b"dsv4enc"])


def embeddings(table: pa.Table) -> list[np.ndarray | None]:
    """Each row's embedding as a (rows, width) array (None for failed rows)."""
    fmt = embedding_format(table.schema)
    return [None if a is None else a.astype(np.float64)
            for a in embedding_arrays(table.column("embedding"), fmt)]


def expected_schema() -> list[tuple[str, pa.DataType]]:
    i32 = pa.int32()
    return [("path", pa.string()), ("width", i32), ("height", i32), ("vit_h", i32),
            ("vit_w", i32), ("grid_h", i32), ("grid_w", i32),
            ("embedding", pa.large_binary()), ("error", pa.string())]


def check_schema(table: pa.Table, value: pa.DataType, width: int) -> None:
    """The default (binary) layout: its metadata names the stored dtype and the width."""
    assert [(f.name, f.type) for f in table.schema] == expected_schema()
    described = meta(table)["embedding"]
    assert described["layout"] == "binary" and described["width"] == width
    assert described["dtype"] == {pa.float16(): "float16", pa.float32(): "float32"}[value]


@pytest.fixture(scope="module")
def run32(tmp_path_factory, tree, ckpt):
    """The tree encoded with float32 compute and output, into a folder that does not exist."""
    out = tmp_path_factory.mktemp("cli_out") / "made" / "on" / "demand" / "e.parquet"
    result = encode(str(tree), "--out", str(out), "--weights", str(ckpt), "--dtype", "float32",
                    "--out-dtype", "float32")
    assert result.exit_code == 0, result.output
    return result, out, pq.read_table(out)


@pytest.fixture(scope="module")
def run16(tmp_path_factory, tree, sharded):
    """The same with the default float16 output, weights (sharded) from DSV4ENC_WEIGHTS."""
    out = tmp_path_factory.mktemp("cli_out16") / "e16.parquet"
    result = encode(str(tree), "--out", str(out), env={"DSV4ENC_WEIGHTS": str(sharded)})
    assert result.exit_code == 0, result.output
    return result, out, pq.read_table(out)


# --------------------------------------------------------------------------- the output

def test_schema_and_metadata(run32, cfg, ckpt):
    _, out, table = run32
    check_schema(table, pa.float32(), HIDDEN)
    info = meta(table)
    assert info["version"] == dsv4enc.__version__
    assert VisionConfig.from_dict(info["config"]) == cfg
    assert info["compute_dtype"] == "float32" and info["out_dtype"] == "float32"
    assert info["features"] == "aligner"
    assert info["weights_fingerprint"] == load_checkpoint(ckpt).fingerprint
    # The output's missing parent folders were created; nothing else is left beside it.
    assert sorted(p.name for p in out.parent.iterdir()) == ["e.parquet"]


def test_one_row_per_image_in_sorted_walk_order(run32):
    result, _, table = run32
    assert table.column("path").to_pylist() == ORDER
    assert ORDER[:6] == ["Zebra.PNG", "a.jpg", "b/deep/d.png", "b/inner.webp", "b-c.gif",
                         "b.jpg"]
    assert ORDER[-3:] == ["x.jpg/y.bmp", "é.png", "日本.jpeg"]
    stderr = result.stderr
    assert summary_count(stderr, "encoded") == len(GOOD)
    assert summary_count(stderr, "failed") == len(BAD)
    assert summary_count(stderr, "skipped (not images)") == len(NOT_IMAGES)


def test_embeddings_equal_the_per_image_forward(run32, tree, cfg, reference):
    _, _, table = run32
    rows = table.to_pylist()
    embs = embeddings(table)
    good = {rel: size for rel, size, _ in GOOD}
    checked = 0
    for row, emb in zip(rows, embs):
        if row["path"] not in good:
            continue
        ref, canvas = reference(tree / row["path"])
        assert (row["width"], row["height"]) == good[row["path"]]
        assert (row["vit_h"], row["vit_w"]) == (canvas.n_h, canvas.n_w)
        r = cfg.downsample_ratio
        assert (row["grid_h"], row["grid_w"]) == (math.ceil(canvas.n_h / r),
                                                  math.ceil(canvas.n_w / r))
        assert emb.shape == (row["grid_h"] * row["grid_w"], HIDDEN)
        assert row["error"] is None
        assert rel_err(torch.from_numpy(emb), ref) < 1e-4, row["path"]
        checked += 1
    assert checked == len(GOOD)
    # The 10:1 image was stretched to max_wh_ratio, the big one scaled into the budget.
    by_path = {row["path"]: row for row in rows}
    assert by_path["日本.jpeg"]["vit_w"] > 4 * by_path["日本.jpeg"]["vit_h"]


def test_bad_files_get_error_rows(run32):
    _, _, table = run32
    for row in table.to_pylist():
        if row["path"] in BAD:
            assert row["embedding"] is None, row["path"]
            assert row["error"] and "\n" not in row["error"], row["path"]
            assert row["vit_h"] is None and row["grid_h"] is None
    assert table.column("embedding").null_count == len(BAD)
    assert table.column("error").null_count == len(GOOD)


def test_float16_output_is_the_float32_output_rounded(run16, run32, ckpt):
    _, _, t16 = run16
    _, _, t32 = run32
    check_schema(t16, pa.float16(), HIDDEN)
    info = meta(t16)
    assert info["out_dtype"] == "float16" and info["compute_dtype"] == "float32"
    # Same tensors, sharded or not: the same fingerprint.
    assert info["weights_fingerprint"] == meta(t32)["weights_fingerprint"]
    assert t16.drop_columns(["embedding"]).equals(t32.drop_columns(["embedding"]))
    for e16, e32 in zip(embeddings(t16), embeddings(t32)):
        if e32 is None:
            assert e16 is None
            continue
        np.testing.assert_allclose(e16, e32.astype(np.float16).astype(np.float64),
                                   rtol=2 ** -10, atol=2 ** -24)


def test_vit_features_files_given_directly_and_files_from(tmp_path, tree, ckpt, reference,
                                                          monkeypatch):
    monkeypatch.chdir(tree)
    listing = tmp_path / "list.txt"
    listing.write_text("é.png\n\nmissing.jpg\nnotes.txt\nx.jpg\n")
    absolute = str(tree / "a.jpg")
    out = tmp_path / "vit.parquet"
    result = encode("b/inner.webp", absolute, "--files-from", str(listing), "--out", str(out),
                    "--features", "vit", "--dtype", "float32", "--out-dtype", "float32",
                    "--weights", str(ckpt))
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    check_schema(table, pa.float32(), DIM)
    assert meta(table)["features"] == "vit"
    # Keys are the paths as given; listed non-images (and a folder) are skipped.
    assert table.column("path").to_pylist() == ["b/inner.webp", absolute, "é.png",
                                                "missing.jpg"]
    assert summary_count(result.stderr, "skipped (not images)") == 2
    rows, embs = table.to_pylist(), embeddings(table)
    for row, emb in zip(rows[:3], embs[:3]):
        ref, canvas = reference(tree / row["path"], "vit")
        assert (row["grid_h"], row["grid_w"]) == (row["vit_h"], row["vit_w"]) == (canvas.n_h,
                                                                                  canvas.n_w)
        assert emb.shape == (canvas.n_h * canvas.n_w, DIM)
        assert rel_err(torch.from_numpy(emb), ref) < 1e-4, row["path"]
    assert rows[3]["embedding"] is None and rows[3]["error"]


def test_file_urls_name_local_paths(tmp_path, tree, ckpt, run32):
    """A ``file://`` input or ``--out`` is its local path (the README: any fsspec scheme); a
    file given so is keyed as given, a folder's images under the folder as given."""
    listing = tmp_path / "list.txt"
    listing.write_text(f"file://{tree / 'b.jpg'}\n")
    image, folder = f"file://{tree / 'a.jpg'}", f"file://{tree / 'b' / 'deep'}/"
    out = tmp_path / "x" / "urls.parquet"
    result = encode(image, folder, str(tree / "x.jpg"), "--files-from", str(listing),
                    "--out", f"file://{out}", "--dtype", "float32", "--out-dtype", "float32",
                    "--weights", str(ckpt))
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column("path").to_pylist() == [
        image, f"file://{tree / 'b' / 'deep'}/d.png", f"{tree}/x.jpg/y.bmp",
        f"file://{tree / 'b.jpg'}"]
    assert table.column("error").to_pylist() == [None] * 4
    plain = {row["path"]: row["embedding"] for row in run32[2].to_pylist()}
    assert [row["embedding"] for row in table.to_pylist()] == [
        plain["a.jpg"], plain["b/deep/d.png"], plain["x.jpg/y.bmp"], plain["b.jpg"]]
    # the --out checks see the local paths: an output folder holding an input is refused
    line = one_line_error(encode(image, "--out", f"file://{tree}/", "--weights", str(ckpt)))
    assert "contains the input" in line


def test_small_row_groups_read_back_identical_and_overwrite(tmp_path, tree, ckpt, run32,
                                                           monkeypatch):
    """Row groups follow ROW_GROUP_BYTES (one row each when it is tiny); the file reads back
    the same. The run replaces an existing --out (an older dsv4enc output: nothing else is
    ever replaced) because --overwrite is given."""
    out = tmp_path / "e.parquet"
    shutil.copy(run32[1], out)
    older = out.read_bytes()
    args = (str(tree), "--out", str(out), "--weights", str(ckpt), "--dtype", "float32",
            "--out-dtype", "float32")
    refused = one_line_error(encode(*args), 1)
    # the line names every way on: replace it, bring it up to date, finish it
    assert all(flag in refused for flag in ("--overwrite", "--update", "--resume")), refused
    assert out.read_bytes() == older
    monkeypatch.setattr(writer, "ROW_GROUP_BYTES", 1)
    result = encode(*args, "--overwrite")
    assert result.exit_code == 0, result.output
    handle = pq.ParquetFile(out)
    assert handle.num_row_groups == len(ORDER)
    assert handle.read().equals(run32[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.parquet"]


def test_row_group_size_is_bounded_by_bytes():
    from dsv4enc.output.parts import Row, output_schema, rows_per_group

    schema = output_schema(1024, "float32")
    big = [Row(path=str(i), embedding=np.zeros((256, 1024), np.float32)) for i in range(4)]
    assert rows_per_group(schema, big) == writer.ROW_GROUP_BYTES // (1 << 20)
    assert 16 << 20 <= writer.ROW_GROUP_BYTES <= 512 << 20  # a sensible size
    tiny = [Row(path="a", embedding=np.zeros((1, 4), np.float16))]
    assert 1 <= rows_per_group(schema, tiny) <= 1 << 20
    assert rows_per_group(schema, [Row(path="bad", error="x")]) >= 1


def test_float16_overflow_fails_and_suggests_float32(tmp_path, tree, cfg, state):
    """An aligner whose outputs exceed 65504: float16 output stops with one line pointing at
    float32 (a real process: exit status, no traceback), and float32 output then works."""
    loud = dict(state)
    for name in ("aligner.w2.weight", "aligner.w2.bias"):
        loud[name] = (state[name].float() * 1e6).to(torch.bfloat16)
    weights = tmp_path / "loud"
    save_checkpoint(weights, cfg, loud, extra=decoy())
    out = tmp_path / "o" / "e.parquet"
    env = {k: v for k, v in os.environ.items() if k != "DSV4ENC_WEIGHTS"}
    proc = subprocess.run([sys.executable, "-m", "dsv4enc", "encode", str(tree / "a.jpg"),
                           "--out", str(out), "--weights", str(weights), "--device", "cpu",
                           "--workers", "0", "-q"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "float32" in lines[0] and "float16" in lines[0], proc.stderr
    assert not out.exists()
    # Following the advice works as typed (the failed run does not block the path).
    again = encode(str(tree / "a.jpg"), "--out", str(out), "--weights", str(weights),
                   "--out-dtype", "float32")
    assert again.exit_code == 0, again.output
    emb = embeddings(pq.read_table(out))[0]
    assert np.isfinite(emb).all() and np.abs(emb).max() > 65504


def test_non_utf8_file_name_is_encoded_with_an_escaped_key(tmp_path, ckpt):
    folder = tmp_path / "imgs"
    folder.mkdir()
    raw = os.fsencode(folder) + b"/caf\xe9.png"
    try:
        os.close(os.open(raw, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:
        pytest.skip("file system refuses non-UTF-8 names")
    write_image(Path(os.fsdecode(raw)), (30, 30), seed=1)
    write_image(folder / "ok.png", (30, 30), seed=2)
    out = tmp_path / "e.parquet"
    result = encode(str(folder), "--out", str(out), "--weights", str(ckpt))
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column("path").to_pylist() == ["caf\\xe9.png", "ok.png"]
    assert table.column("error").null_count == 2


# --------------------------------------------------------------------------- setup errors

def test_missing_input_fails_before_writing_anything(tmp_path, ckpt):
    out = tmp_path / "never" / "e.parquet"
    result = encode(str(tmp_path / "[/x]no:smile:pe"), "--out", str(out), "--weights", str(ckpt))
    line = one_line_error(result, 2)
    assert "not found" in line and "[/x]no:smile:pe" in line  # as is: no markup, no emoji
    assert not (tmp_path / "never").exists()


def test_the_summary_shows_a_failed_file_s_name_as_it_is(tmp_path, ckpt):
    """A name holding ``:smile:`` is text in the summary's error examples, not an emoji."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a:smile:b.jpg").write_bytes(b"not an image")
    result = encode(str(tmp_path / "in"), "--out", str(tmp_path / "e.parquet"), "--weights",
                    str(ckpt))
    assert result.exit_code == 0, result.output
    assert "(e.g. a:smile:b.jpg)" in result.stderr


def test_weights_errors(tmp_path, tree, ckpt):
    out = tmp_path / "o" / "e.parquet"
    image = str(tree / "a.jpg")
    # None given, no DSV4ENC_WEIGHTS: a usage error that names both ways to give them.
    line = one_line_error(encode(image, "--out", str(out)), 2)
    assert "--weights" in line and "DSV4ENC_WEIGHTS" in line
    # DSV4ENC_WEIGHTS (or --weights) pointing nowhere.
    line = one_line_error(encode(image, "--out", str(out),
                                 env={"DSV4ENC_WEIGHTS": str(tmp_path / "gone")}), 1)
    assert "gone" in line
    # A broken config.json and a truncated weights file.
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "config.json").write_text("{not json")
    assert "config" in one_line_error(encode(image, "--out", str(out), "--weights",
                                             str(broken)), 1)
    shutil.copy(ckpt / "config.json", broken / "config.json")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
    one_line_error(encode(image, "--out", str(out), "--weights", str(broken)), 1)
    # None of these created the output folder.
    assert not (tmp_path / "o").exists()


def test_random_init_sets_aside_the_weights_of_the_environment(tmp_path, tree):
    """DSV4ENC_WEIGHTS is a default that --random-init sets aside (an explicit --weights with
    it is refused): the option's source is read whatever Click carries it (Typer 0.26+ has
    its own)."""
    image = str(tree / "a.jpg")
    args = ("--config", str(CONFIGS / "tiny.json"), "--random-init", "-q")
    result = encode(image, "--out", str(tmp_path / "e.parquet"), *args,
                    env={"DSV4ENC_WEIGHTS": str(tmp_path / "gone")})
    assert result.exit_code == 0, result.output
    refused = encode(image, "--out", str(tmp_path / "f.parquet"), *args, "--weights",
                     str(tmp_path / "gone"))
    assert refused.exit_code != 0


def test_option_and_output_errors(tmp_path, tree, ckpt):
    image = str(tree / "a.jpg")
    base = ("--weights", str(ckpt))
    line = one_line_error(encode(image, "--out", str(tmp_path / "e.parquet"), *base,
                                 "--features", "pixels"), 2)
    assert "--features" in line
    one_line_error(encode(image, "--out", str(tmp_path / "e.parquet"), *base,
                          "--out-dtype", "int8"), 2)
    one_line_error(encode(image, "--out", str(tmp_path / "e.parquet"), "--random-init"), 2)
    one_line_error(encode("--out", str(tmp_path / "e.parquet"), *base), 2)  # no inputs
    (tmp_path / "file").write_text("")
    line = one_line_error(encode(image, "--out", str(tmp_path / "file" / "e.parquet"), *base), 1)
    assert "file" in line
    # a Ray option without --engine ray (it was ignored: the run went on locally)
    for ray in (("--ray-actors", "4"), ("--ray-gpus-per-actor", "1"), ("--ray-address", "h:1")):
        line = one_line_error(encode(image, "--out", str(tmp_path / "r.parquet"), *base, *ray), 2)
        assert f"{ray[0]} applies to --engine ray" in line, line
        assert not (tmp_path / "r.parquet").exists()
    # $RAY_ADDRESS is no option given: a local run goes on
    assert encode(image, "--out", str(tmp_path / "r.parquet"), *base,
                  env={"RAY_ADDRESS": "h:1"}).exit_code == 0
    # Click's own usage errors: exit 2, no traceback.
    for args in (["encode", image], ["encode", image, "--out", "x", "--no-such-flag"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output


def test_torchrun_options_in_one_process(tmp_path, tree, ckpt, run32):
    """--tp-mode weights in one process (no torchrun, or torchrun with one rank) would encode
    with the tower whole, unsaid: it is refused in one usage line naming the cause, before
    anything is written. --balance only decides how ranks share the images: one process takes
    them all, so it is accepted (one command serves both launches), the rows the same."""
    image = str(tree / "a.jpg")
    base = ("--weights", str(ckpt))
    for env in ({}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}):
        out = tmp_path / "tp" / "e.parquet"
        line = one_line_error(encode(image, "--out", str(out), *base, "--tp-mode", "weights",
                                     env=env), 2)
        assert line == ("error: --tp-mode weights splits the tower across torchrun ranks: run "
                        "it under torchrun with 2 or more ranks"), line
        assert not (tmp_path / "tp").exists()
    out = tmp_path / "flops.parquet"
    result = encode(str(tree), "--out", str(out), *base, "--dtype", "float32", "--out-dtype",
                    "float32", "--balance", "flops")
    assert result.exit_code == 0, result.output
    got, want = pq.read_table(out), run32[2]
    assert got.column("path").to_pylist() == want.column("path").to_pylist()
    assert all(a is None and b is None or np.array_equal(a, b)
               for a, b in zip(embeddings(got), embeddings(want)))


# --------------------------------------------------------------------------- help, version

def test_help_lists_and_explains_every_option():
    """Every parameter of encode has its help written (in ENCODE_OPTIONS: what the help
    shows of an argument is Typer's and Click's, and Typer 0.25 with Click 8.5 drops it), and
    every option's flags are in the help."""
    from dsv4enc.cli import ENCODE_OPTIONS

    for name, info in ENCODE_OPTIONS.items():
        assert (info.help or "").strip(), f"{name} has no help"
    command = typer.main.get_command(app)
    encode_cmd = command.commands["encode"]
    result = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "250"}, terminal_width=250)
    assert result.exit_code == 0
    text = result.output
    for param in encode_cmd.params:
        if getattr(param, "hidden", False):
            continue
        assert param.name in ENCODE_OPTIONS or param.name == "help", param.name
        for opt in list(param.opts) + list(param.secondary_opts):
            if opt.startswith("-"):
                assert opt in text, opt
    assert "DSV4ENC_WEIGHTS" in text
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "250"}, terminal_width=250)
    assert top.exit_code == 0 and "encode" in top.output and "--version" in top.output


def test_encode_help_states_the_defaults_the_code_uses():
    """--dtype's help names every CPU kind where auto picks bfloat16 (each AMD Zen that was
    measured faster: the help said Zen 5 only, and float32 elsewhere), and --batch-tokens'
    help the engine's defaults."""
    from dsv4enc.cli import ENCODE_OPTIONS
    from dsv4enc.engine.cpufeatures import CLEAR_WIN, MEASURED_KINDS
    from dsv4enc.engine.defaults import DEFAULT_BATCH_TOKENS

    zens = [re.search(r"Zen \d", kind.where) for kind in MEASURED_KINDS
            if kind.bf16_speedup > CLEAR_WIN]
    assert [zen.group() for zen in zens if zen], MEASURED_KINDS
    for zen in filter(None, zens):
        assert zen.group() in ENCODE_OPTIONS["dtype"].help, zen.group()
    for device, tokens in DEFAULT_BATCH_TOKENS.items():
        assert f"{tokens} on {device.upper() if device == 'cpu' else 'CUDA'}" in (
            ENCODE_OPTIONS["batch_tokens"].help), device


def test_encode_help_groups_its_options_into_panels():
    """Every option of encode sits in one panel of ENCODE_PANELS; the panels come in the
    table's order; at 100 columns the help stays short and the --storage-option example is
    shown whole; bench's one-line description is a whole sentence."""
    from dsv4enc.cli import ENCODE_PANELS

    encode_cmd = typer.main.get_command(app).commands["encode"]
    placed = [name for names in ENCODE_PANELS.values() for name in names]
    assert len(placed) == len(set(placed))
    options = {param.name for param in encode_cmd.params
               if param.param_type_name == "option" and param.name != "help"}
    assert options == set(placed), options ^ set(placed)
    result = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "100"},
                           terminal_width=100)
    assert result.exit_code == 0
    text = result.output
    titles = [line.split("─ ", 1)[1].split(" ─")[0] for line in text.splitlines()
              if line.startswith("╭─ ")]
    assert titles == ["Arguments", "Options", *ENCODE_PANELS], titles
    assert len(text.splitlines()) < 180  # it was 207 before the panels
    assert "endpoint_override=host:9000, anonymous=true" in " ".join(text.split())
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "100"}, terminal_width=100)
    assert "Time the engine, or with --host the host side alone." in top.output


def test_flags_show_no_value_type_and_documented_options_are_shown():
    """A flag takes no value, so --help shows none for it (Typer would print ``<bool>``, as
    if ``--version true`` were asked for), in every command's help; --part-images, which the
    docs name, is shown."""
    for args in (["--help"], ["encode", "--help"], ["inspect", "--help"], ["bench", "--help"],
                 ["extract", "--help"]):
        result = runner.invoke(app, args, env={"COLUMNS": "100"}, terminal_width=100)
        assert result.exit_code == 0 and "--help" in result.output
        assert "<bool>" not in result.output and "BOOLEAN" not in result.output, args
    encode_help = runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "100"},
                                terminal_width=100).output
    assert "--part-images" in encode_help and "--exclude" in encode_help
    assert "--keep-member" in encode_help


def test_version_module_and_console_script():
    proc = subprocess.run([sys.executable, "-m", "dsv4enc", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dsv4enc {dsv4enc.__version__}"
    script = (shutil.which("dsv4enc")
              or shutil.which("dsv4enc", path=str(Path(sys.executable).parent)))
    if script is None:
        pytest.skip("the dsv4enc console script is not installed")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dsv4enc {dsv4enc.__version__}"


# --------------------------------------------------------------------------- quickstart

def test_readme_quickstart(tmp_path):
    """examples/make_images.py (same bytes every time) and the README's random-init run."""
    script = str(REPO_ROOT / "examples" / "make_images.py")
    first, second = tmp_path / "one", tmp_path / "two"
    runpy.run_path(script)["make_images"](first)
    runpy.run_path(script)["make_images"](second)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert len(files) >= 8
    assert {p.suffix for p in files} >= {".jpg", ".png", ".webp", ".txt"}
    assert any(len(p.parts) > 1 for p in files)
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel
    out = tmp_path / "emb.parquet"
    result = encode(str(first), "--out", str(out), "--config", str(CONFIGS / "tiny.json"),
                    "--random-init")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    errors = [e for e in table.column("error").to_pylist() if e is not None]
    assert len(errors) == 1
    assert summary_count(result.stderr, "skipped (not images)") == 1
    assert summary_count(result.stderr, "encoded") == table.num_rows - 1


def test_bench_command_is_exposed():
    """bench --help names its options, and every attention backend and feature kind it
    takes, as encode's does (it left out grouped)."""
    from dsv4enc.engine.defaults import FEATURES
    from dsv4enc.tower.config import ATTENTION_BACKENDS

    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "250"}, terminal_width=250)
    assert result.exit_code == 0
    for option in ("--config", "--images", "--batch-tokens", "--graphs", "--e2e"):
        assert option in result.output
    for choices in (ATTENTION_BACKENDS, FEATURES):
        assert f"[{'|'.join(choices)}]" in result.output, choices


def test_help_descriptions_are_wrapped_by_the_terminal_not_the_source():
    """Each command's description flows at the terminal's width: where the docstring breaks
    a line, a wide terminal shows the words on both sides of the break on one line (bench's
    "measured in the / same process" was cut there), and a narrow one shows no line wider
    than itself."""
    import inspect as pyinspect

    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        wide = runner.invoke(app, [name, "--help"], env={"COLUMNS": "250"}, terminal_width=250)
        assert wide.exit_code == 0, wide.output
        shown = [" ".join(line.split()) for line in wide.output.splitlines()]
        source = pyinspect.cleandoc(command.callback.__doc__).splitlines()
        for above, below in zip(source, source[1:]):
            if above.strip() and below.strip():  # a break inside a paragraph
                joined = f"{above.split()[-1]} {below.split()[0]}"
                assert any(joined in line for line in shown), (name, joined)
        narrow = runner.invoke(app, [name, "--help"], env={"COLUMNS": "60"}, terminal_width=60)
        assert narrow.exit_code == 0
        assert max(len(line.rstrip()) for line in narrow.output.splitlines()) <= 60


def test_decode_workers_and_a_stdin_listing_give_the_inline_rows(tmp_path, tree, ckpt, run32,
                                                                 monkeypatch):
    """With a decode worker the run is planned and decoding starts before torch is loaded
    (the head start), reading the --files-from listing from stdin exactly once: same rows as
    the inline-decoding run of the whole tree."""
    monkeypatch.chdir(tree)
    listing = "\n".join(ORDER) + "\n"
    out = tmp_path / "worker.parquet"
    result = runner.invoke(app, ["encode", "--files-from", "-", "--out", str(out), "--weights",
                                 str(ckpt), "--dtype", "float32", "--out-dtype", "float32",
                                 "--device", "cpu", "--workers", "1", "-q"],
                           input=listing, env={"DSV4ENC_WEIGHTS": None, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    got, want = pq.read_table(out), run32[2]
    assert got.column("path").to_pylist() == ORDER
    assert got.drop_columns(["path", "error"]).equals(want.drop_columns(["path", "error"]))
    # Error messages may quote the path as given (relative here, absolute in the tree run).
    kinds = [[e and e.split(":")[0] for e in t.column("error").to_pylist()] for t in (got, want)]
    assert kinds[0] == kinds[1]


def test_an_errors_list_to_standard_output_is_refused(tmp_path, tree, ckpt, monkeypatch):
    """inspect --errors-list - wrote a file named '-', then advised 'encode --files-from -',
    which reads standard input: one line, exit 2, nothing written."""
    out = tmp_path / "e.parquet"
    assert encode(str(tree / "bad"), "--out", str(out), "--weights", str(ckpt)).exit_code == 0
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    line = one_line_error(runner.invoke(app, ["inspect", str(out), "--errors-list", "-"]), 2)
    assert "--errors-list -" in line and "file" in line, line
    assert os.listdir(here) == []


@pytest.mark.parametrize("where", ["missing/x.json", "a_folder"])
def test_a_bench_json_that_cannot_be_written_is_refused_before_the_timing(tmp_path, where):
    """bench --json into a missing folder, or naming a folder, is one line before anything
    is timed; it was a traceback once the timing (minutes) was over."""
    (tmp_path / "a_folder").mkdir()
    result = runner.invoke(app, ["bench", "--dtype-check", "--json", str(tmp_path / where)])
    line = one_line_error(result, 1)
    assert f"--json {tmp_path / where}" in line, line
    assert sorted(os.listdir(tmp_path)) == ["a_folder"]


@pytest.mark.parametrize("option", [["--batch-tokens", "0"], ["--batch-tokens=-5"],
                                    ["--max-images", "0"], ["--repeat", "0"],
                                    ["--threads", "0"], ["--threads=-1"],
                                    ["--naive-images=-3"]])
def test_a_bench_count_that_is_not_positive_is_one_line(option):
    """bench --batch-tokens, --max-images, --repeat, --threads or --naive-images of 0 or less
    is one line, exit 2, before anything is timed, as encode refuses them; a negative one was
    a traceback (torch's RuntimeError, an IndexError), and a 0 timed a run of no budget,
    images or rounds, or was ignored."""
    result = runner.invoke(app, ["bench", "--config", str(CONFIGS / "tiny.json"),
                                 "--images", "synthetic:30x30:1", *option])
    line = one_line_error(result, 2)
    assert option[0].split("=")[0] in line and "positive" in line, line


def test_a_bench_json_over_a_file_bench_did_not_write_is_refused(tmp_path):
    """bench --json naming a file that is there and is not bench's JSON (a user's Parquet
    file, a config) is one line, the file left as it is; it was overwritten with the rows
    (dsv4enc replaces only what it wrote)."""
    for name, data in (("emb.parquet", b"PAR1 user data PAR1"), ("config.json", b'{"a": 1}')):
        owned = tmp_path / name
        owned.write_bytes(data)
        line = one_line_error(runner.invoke(app, ["bench", "--dtype-check", "--json",
                                                  str(owned)]), 1)
        assert f"--json {owned}" in line and "exists" in line, line
        assert owned.read_bytes() == data


@pytest.mark.parametrize("option, choices", [("--graphs", "auto, on, off"), ("--fused", "on, off")])
def test_a_bench_on_off_word_it_does_not_know_is_named_with_its_option(option, choices):
    """bench --graphs or --fused with a word it does not know is one line naming the option
    and the words it takes; it said only "bad benchmark option: 'maybe'"."""
    result = runner.invoke(app, ["bench", "--config", str(CONFIGS / "tiny.json"),
                                 "--images", "synthetic:30x30:1", option, "on,maybe"])
    line = one_line_error(result, 2)
    assert option in line and "'maybe'" in line and choices in line, line


@pytest.mark.parametrize("option, says", [(["--images", "synthetic:foo"], "synthetic:WxH"),
                                          (["--images", "synthetic:mix:x"], "synthetic:WxH"),
                                          (["--batch-tokens", "abc"], "--batch-tokens")])
def test_a_bench_spec_it_cannot_read_names_what_it_takes(option, says):
    """bench --images synthetic:... or --batch-tokens that is not of their form is one line
    naming the option's form; it said only Python's "invalid literal for int() ..."."""
    result = runner.invoke(app, ["bench", "--config", str(CONFIGS / "tiny.json"),
                                 "--images", "synthetic:30x30:1", *option])
    line = one_line_error(result, 2)
    assert says in line and "invalid literal" not in line, line
