"""``dsv4enc extract``: a vision-only checkpoint, bytes as stored, same fingerprint and
embeddings as the full checkpoint it came from."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from dsv4enc.tower.checkpoint import is_tower_tensor, load_checkpoint
from dsv4enc.cli import app
from dsv4enc.errors import OutputError, WeightsError
from dsv4enc.tower.export import extract_tower

from helpers import nested_layout, write_checkpoint, write_image

runner = CliRunner()


def tensors_as_stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update({n: handle.get_tensor(n) for n in handle.keys()})
    return out


def test_extract_copies_tower_tensors_as_stored(sharded_ckpt, tiny_cfg, tmp_path):
    out = tmp_path / "vision"
    result = runner.invoke(app, ["extract", str(sharded_ckpt), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    source = {n: t for n, t in tensors_as_stored(sharded_ckpt).items() if is_tower_tensor(n)}
    ours = tensors_as_stored(out)
    assert ours.keys() == source.keys()
    for name, tensor in source.items():
        assert ours[name].dtype == tensor.dtype, name  # bf16 stays bf16, norms float32
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
    config = json.loads((out / "config.json").read_text())
    assert config == tiny_cfg.to_flat()  # model_type included
    assert load_checkpoint(out).fingerprint == load_checkpoint(sharded_ckpt).fingerprint


def test_extracted_checkpoint_encodes_identically(tiny_ckpt, tmp_path):
    out = tmp_path / "vision"
    extract_tower(tiny_ckpt, out)
    images = tmp_path / "images"
    write_image(images / "a.png", (40, 30))
    write_image(images / "b.jpg", (25, 60))
    results = {}
    for name, weights in (("full", tiny_ckpt), ("vision", out)):
        target = tmp_path / f"{name}.parquet"
        result = runner.invoke(app, ["encode", str(images), "--out", str(target), "--weights",
                                     str(weights), "--workers", "0", "--device", "cpu", "-q"])
        assert result.exit_code == 0, result.output
        results[name] = pq.read_table(target)
    full, vision = results["full"], results["vision"]
    assert full.column("embedding").equals(vision.column("embedding"))
    meta = [json.loads(t.schema.metadata[b"dsv4enc"]) for t in (full, vision)]
    assert meta[0]["weights_fingerprint"] == meta[1]["weights_fingerprint"]
    assert meta[0]["config"] == meta[1]["config"]


def test_extract_from_nested_layout_writes_flat_config(tiny_cfg, tiny_state, tmp_path):
    source = write_checkpoint(tmp_path / "nested", nested_layout(tiny_cfg.to_flat()),
                              {"model.safetensors": tiny_state}, index=False)
    out = tmp_path / "flat"
    done = extract_tower(source, out)
    assert done.tensors == len(tiny_state)
    config = json.loads((out / "config.json").read_text())
    assert config["vision_dim"] == tiny_cfg.dim and "vision_config" not in config
    assert config["model_type"] == "deepseek_v4"


def test_extract_refusals(tiny_ckpt, tiny_cfg, tiny_state, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="holds keep.txt, which dsv4enc extract did not"):
            extract_tower(tiny_ckpt, busy, overwrite=overwrite)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with pytest.raises(OutputError, match="differ"):
        extract_tower(tiny_ckpt, tiny_ckpt, overwrite=True)
    partial = {n: t for n, t in tiny_state.items() if n != "vision.norm.weight"}
    broken = write_checkpoint(tmp_path / "broken", tiny_cfg.to_flat(),
                              {"model.safetensors": partial}, index=False)
    with pytest.raises(WeightsError, match="vision.norm.weight"):
        extract_tower(broken, tmp_path / "x")
    result = runner.invoke(app, ["extract", str(tmp_path / "nowhere"), "--out",
                                 str(tmp_path / "y")])
    assert result.exit_code == 1 and "not found" in result.output
    assert np.all([not p.name.startswith(".") for p in busy.iterdir()])  # no temp file left


@pytest.mark.parametrize("fault", ["config", "shape", "dtype"])
def test_a_bad_source_is_one_line_and_makes_no_out_folder(tiny_cfg, tiny_state, tmp_path, fault):
    tensors = dict(tiny_state)
    if fault == "shape":
        tensors["aligner.w1.weight"] = tiny_state["aligner.w1.weight"].t().contiguous()
    if fault == "dtype":
        tensors["aligner.w1.weight"] = tiny_state["aligner.w1.weight"].to(torch.int32)
    source = write_checkpoint(tmp_path / "src", tiny_cfg.to_flat(),
                              {"model.safetensors": tensors}, index=False)
    if fault == "config":
        (source / "config.json").write_text("{")
    result = runner.invoke(app, ["extract", str(source), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_a_full_disk_writing_config_json_is_one_line(tiny_ckpt, tmp_path, monkeypatch):
    real_write_text = Path.write_text

    def write_text(path, text, *args, **kwargs):
        if path.name == "config.json":
            real_write_text(path, text[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    result = runner.invoke(app, ["extract", str(tiny_ckpt), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "config.json" in result.output and "No space left" in result.output
    assert not (tmp_path / "out" / "config.json").exists()


def test_overwrite_replaces_an_earlier_extract_and_nothing_else(tiny_ckpt, sharded_ckpt,
                                                                 tmp_path):
    """--overwrite replaces an earlier extract's files, known by the marker in its weights'
    header; a folder holding another checkpoint (a sharded one) is refused, left as it was."""
    out = tmp_path / "vision"
    extract_tower(tiny_ckpt, out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "dsv4enc": "extract"}
    with pytest.raises(OutputError, match="earlier extract; pass --overwrite"):
        extract_tower(sharded_ckpt, out)
    extract_tower(sharded_ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_checkpoint(out).fingerprint == load_checkpoint(sharded_ckpt).fingerprint

    other = tmp_path / "other"
    shutil.copytree(sharded_ckpt, other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    result = runner.invoke(app, ["extract", str(tiny_ckpt), "-o", str(other), "--overwrite"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "holds config.json, which dsv4enc extract did not write" in result.output
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    (out / "model.safetensors").unlink()  # an extract's config.json alone is no extract's
    with pytest.raises(OutputError, match="holds config.json"):
        extract_tower(tiny_ckpt, out, overwrite=True)
