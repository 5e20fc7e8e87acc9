"""``--weights owner/name``: weights from the Hugging Face Hub cache, tower shards only.

Runs offline against a cache folder laid out as the Hub lays it out
(``models--owner--name/refs/main`` + ``snapshots/<rev>/...``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsv4enc import Encoder
from dsv4enc.tower import hub
from dsv4enc.tower.checkpoint import INDEX_NAME, load_checkpoint, tower_index
from dsv4enc.cli import app
from dsv4enc.errors import WeightsError

from helpers import DECOY_ONLY_FILE, SHARD_FILES, record_hub_downloads

REPO = "deepseek-ai/DeepSeek-V4-Flash-Vision-Exp"
REVISION = "0123456789abcdef0123456789abcdef01234567"
runner = CliRunner()


@pytest.fixture
def hf():
    return pytest.importorskip("huggingface_hub")


@pytest.fixture
def cache(tmp_path, sharded_ckpt, monkeypatch) -> Path:
    """An offline Hub cache holding the sharded tiny checkpoint, without its decoy-only shard
    (fetching that one would fail: nothing may ask for it)."""
    root = tmp_path / "hub"
    repo = root / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in ("config.json", INDEX_NAME, *SHARD_FILES):
        shutil.copy(sharded_ckpt / name, snapshot / name)
    assert (sharded_ckpt / DECOY_ONLY_FILE).is_file()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


@pytest.fixture
def requested(hf, monkeypatch) -> list[str]:
    """File names asked of huggingface_hub, in order."""
    return record_hub_downloads(hf, monkeypatch)


def test_only_config_index_and_tower_shards_are_fetched(cache, requested, sharded_ckpt):
    folder = hub.resolve_weights(REPO)
    assert folder == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    assert requested == ["config.json", INDEX_NAME, *sorted(SHARD_FILES)]
    assert DECOY_ONLY_FILE not in requested
    ours = load_checkpoint(folder)
    assert ours.fingerprint == load_checkpoint(sharded_ckpt).fingerprint
    assert hub.resolve_weights(f"{REPO}@main") == folder


def test_encoder_and_cli_take_a_hub_id(cache, requested, tmp_path, sharded_ckpt):
    enc = Encoder.from_pretrained(REPO, device="cpu", dtype=torch.float32)
    assert enc.fingerprint == load_checkpoint(sharded_ckpt).fingerprint
    image = tmp_path / "x.png"
    from helpers import write_image

    write_image(image, (20, 20))
    out = tmp_path / "o.parquet"
    result = runner.invoke(app, ["encode", str(image), "--out", str(out), "--weights", REPO,
                                 "--workers", "0", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    assert DECOY_ONLY_FILE not in requested


def test_uncached_offline_and_missing_package_are_one_line_errors(cache, hf, monkeypatch,
                                                                  tmp_path):
    with pytest.raises(WeightsError, match="not in the local Hub cache and HF_HUB_OFFLINE"):
        hub.resolve_weights("someone/absent-model")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(WeightsError, match=r"pip install 'dsv4enc\[hub\]'"):
        hub.resolve_weights(REPO)
    result = runner.invoke(app, ["encode", str(tmp_path), "--out", str(tmp_path / "o.parquet"),
                                 "--weights", REPO, "-q"])
    assert result.exit_code == 1
    assert "dsv4enc[hub]" in result.output and "Traceback" not in result.output


def test_hub_ids_versus_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("owner/name") and hub.is_hub_id("owner/name@v1.0")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not hub.is_hub_id("owner/name")  # an existing folder wins
    assert hub.resolve_weights("owner/name") == Path("owner/name")
    for local in ("./a/b", "/abs/path", "a/b/c", "a", "../x/y"):
        assert not hub.is_hub_id(local)
    monkeypatch.setenv("HOME", str(tmp_path))  # a quoted --weights=~/... or DSV4ENC_WEIGHTS
    assert not hub.is_hub_id("~/owner/name")
    assert hub.resolve_weights("~/owner/name") == tmp_path / "owner" / "name"
    index = tmp_path / "index.json"
    weight_map = {"vision.x": "s1", "aligner.y": "s2", "embed": "s3"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert tower_index(index) == {"vision.x": "s1", "aligner.y": "s2"}
