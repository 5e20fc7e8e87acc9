"""Checkpoint loading (SPEC §1-2): only the tower's tensors, from only the files holding them;
clear errors naming the tensor or key; a fingerprint of the weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import dsv4enc.tower.checkpoint as checkpoint
from dsv4enc.tower.checkpoint import (INDEX_NAME, build_tower, load_checkpoint, random_checkpoint,
                                save_checkpoint)
from dsv4enc.errors import ConfigError, DsvError, WeightsError

from helpers import (DECOY_ONLY_FILE, SHARD_FILES, decoy_tensors, nested_layout,
                     write_checkpoint)

NORM = "vision.blocks.0.norm1.weight"
WEIGHT = "vision.blocks.1.attn.wo.weight"


class SafeOpenSpy:
    """Stands in for ``safe_open`` in the loader: records files opened and tensors touched."""

    def __init__(self, real):
        self.real = real
        self.opened: list[str] = []
        self.read: list[str] = []  # get_tensor
        self.sliced: list[str] = []  # get_slice (header/shape access)

    def __call__(self, path, *args, **kwargs):
        self.opened.append(Path(path).name)
        return _SpyHandle(self, self.real(path, *args, **kwargs))


class _SpyHandle:
    def __init__(self, spy: SafeOpenSpy, inner):
        self.spy, self.inner, self.handle = spy, inner, None

    def __enter__(self):
        self.handle = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        self.spy.sliced.append(name)
        return self.handle.get_slice(name)

    def get_tensor(self, name):
        self.spy.read.append(name)
        return self.handle.get_tensor(name)

    def __getattr__(self, attr):
        return getattr(self.handle, attr)


@pytest.fixture
def spy(monkeypatch) -> SafeOpenSpy:
    recorder = SafeOpenSpy(checkpoint.safe_open)
    monkeypatch.setattr(checkpoint, "safe_open", recorder)
    return recorder


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for path in dst.iterdir():
        path.chmod(0o644)
    return dst


def write_tower(folder: Path, cfg, tensors: dict, config: dict | None = None,
                index: bool = False) -> Path:
    """A one-file checkpoint holding ``tensors`` (plus a decoy) with config ``config``."""
    decoy = torch.zeros(4, 4, dtype=torch.bfloat16)
    files = {"model.safetensors": {**tensors, "embed.weight": decoy}}
    return write_checkpoint(folder, config or cfg.to_flat(), files, index=index)


def assert_matches_stored(state: dict, stored: dict, dtype: torch.dtype):
    assert set(state) == set(stored)
    for name, tensor in stored.items():
        want = tensor.to(torch.float32) if tensor.dtype == torch.float32 else tensor.to(dtype)
        assert state[name].dtype == want.dtype, name
        assert torch.equal(state[name], want), name


# --------------------------------------------------------------------------- what is read

def test_index_reads_only_tower_tensors_from_tower_shards(sharded_ckpt, tiny_state, spy):
    ckpt = load_checkpoint(sharded_ckpt)
    assert sorted(set(spy.opened)) == sorted(SHARD_FILES)
    assert DECOY_ONLY_FILE not in spy.opened
    assert sorted(spy.read) == sorted(tiny_state), "every tower tensor read once, nothing else"
    assert all(checkpoint.is_tower_tensor(n) for n in spy.sliced)
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


def test_sharded_fixture_holds_fp8_and_int_decoys(sharded_ckpt):
    from safetensors import safe_open

    dtypes = set()
    for fname in (*SHARD_FILES, DECOY_ONLY_FILE):
        with safe_open(str(sharded_ckpt / fname), framework="pt") as handle:
            dtypes |= {handle.get_slice(n).get_dtype() for n in handle.keys()
                       if not checkpoint.is_tower_tensor(n)}
    assert "I8" in dtypes
    if hasattr(torch, "float8_e4m3fn"):
        assert "F8_E4M3" in dtypes
    with safe_open(str(sharded_ckpt / DECOY_ONLY_FILE), framework="pt") as handle:
        assert not any(checkpoint.is_tower_tensor(n) for n in handle.keys())


def test_index_entries_for_missing_language_model_files_are_ignored(tmp_path, tiny_cfg,
                                                                    tiny_state, spy):
    """Only the shards that hold tower tensors need exist (a partial download is fine)."""
    missing = {f"layers.{i}.ffn.w1.weight": "model-00009-of-00009.safetensors" for i in range(3)}
    folder = write_checkpoint(tmp_path / "ckpt", tiny_cfg.to_flat(),
                              {"tower.safetensors": tiny_state}, index_extra=missing)
    ckpt = load_checkpoint(folder)
    assert spy.opened == ["tower.safetensors"]
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


def test_header_scan_without_index(tmp_path, sharded_ckpt, tiny_state, spy):
    folder = copy_ckpt(sharded_ckpt, tmp_path / "ckpt")
    (folder / INDEX_NAME).unlink()
    ckpt = load_checkpoint(folder)
    assert sorted(spy.read) == sorted(tiny_state)
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


def test_single_file_checkpoint_with_decoy(tiny_ckpt, tiny_state, tiny_cfg, spy):
    ckpt = load_checkpoint(tiny_ckpt)
    assert ckpt.config == tiny_cfg
    assert sorted(spy.read) == sorted(tiny_state)
    assert "embed.weight" not in spy.sliced
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_load_straight_into_compute_dtype_norms_float32(tiny_ckpt, tiny_state, dtype):
    ckpt = load_checkpoint(tiny_ckpt, dtype=dtype)
    assert_matches_stored(ckpt.state_dict, tiny_state, dtype)
    assert ckpt.state_dict[NORM].dtype == torch.float32
    assert ckpt.state_dict["vision.norm.weight"].dtype == torch.float32
    assert ckpt.state_dict[WEIGHT].dtype == dtype
    model = build_tower(ckpt)
    assert model.dtype == dtype
    assert model.vision.blocks[0].norm1.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_nested_config_layout_loads_identically(tmp_path, tiny_ckpt):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "nested")
    flat = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(nested_layout(flat)))
    a, b = load_checkpoint(tiny_ckpt), load_checkpoint(folder)
    assert a.config == b.config
    assert a.fingerprint == b.fingerprint
    assert_matches_stored(b.state_dict, {n: t for n, t in a.state_dict.items()}, torch.float32)


def test_save_checkpoint_round_trip_with_shards(tmp_path, tiny_cfg, tiny_state):
    save_checkpoint(tmp_path / "ckpt", tiny_cfg, tiny_state, extra=decoy_tensors(), shards=3)
    assert (tmp_path / "ckpt" / INDEX_NAME).is_file()
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.config == tiny_cfg
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


# --------------------------------------------------------------------------- fingerprint

def test_fingerprint_stable_across_loads_dtypes_and_layouts(tiny_ckpt, sharded_ckpt):
    prints = {load_checkpoint(tiny_ckpt, dtype=d).fingerprint
              for d in (torch.float32, torch.bfloat16, torch.float16)}
    prints.add(load_checkpoint(tiny_ckpt).fingerprint)
    prints.add(load_checkpoint(sharded_ckpt).fingerprint)  # same weights, other sharding
    assert len(prints) == 1


@pytest.mark.parametrize("name", [WEIGHT, NORM])
def test_fingerprint_changes_when_a_weight_changes(tmp_path, tiny_cfg, tiny_state, tiny_ckpt, name):
    changed = dict(tiny_state)
    tensor = changed[name].clone()
    tensor.view(-1)[3] += 1
    changed[name] = tensor
    folder = write_tower(tmp_path / "ckpt", tiny_cfg, changed)
    assert load_checkpoint(folder).fingerprint != load_checkpoint(tiny_ckpt).fingerprint


def test_fingerprint_changes_with_stored_dtype(tmp_path, tiny_cfg, tiny_state, tiny_ckpt):
    """The same values stored in another dtype are different weights bytes."""
    as_fp32 = {n: t.float() for n, t in tiny_state.items()}
    folder = write_tower(tmp_path / "ckpt", tiny_cfg, as_fp32)
    ckpt = load_checkpoint(folder)
    assert ckpt.fingerprint != load_checkpoint(tiny_ckpt).fingerprint
    assert_matches_stored(ckpt.state_dict, tiny_state, torch.float32)


def test_random_checkpoint_is_deterministic(tiny_cfg):
    a, b = random_checkpoint(tiny_cfg, seed=3), random_checkpoint(tiny_cfg, seed=3)
    assert a.fingerprint == b.fingerprint != random_checkpoint(tiny_cfg, seed=4).fingerprint
    assert all(torch.equal(a.state_dict[n], b.state_dict[n]) for n in a.state_dict)


# --------------------------------------------------------------------------- tower tensor errors

@pytest.mark.parametrize("index", [False, True], ids=["scan", "index"])
def test_missing_tensor_is_named(tmp_path, tiny_cfg, tiny_state, index):
    tensors = {n: t for n, t in tiny_state.items() if n != WEIGHT}
    folder = write_tower(tmp_path / "ckpt", tiny_cfg, tensors, index=index)
    with pytest.raises(WeightsError, match=f"missing tower tensor {WEIGHT}"):
        load_checkpoint(folder)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, tiny_cfg, tiny_state):
    tensors = dict(tiny_state, **{WEIGHT: tiny_state[WEIGHT][:, :31].contiguous()})
    folder = write_tower(tmp_path / "ckpt", tiny_cfg, tensors)
    with pytest.raises(WeightsError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert WEIGHT in message and "[32, 31]" in message and "[32, 32]" in message


def test_transposed_weight_is_a_shape_error(tmp_path, tiny_cfg, tiny_state):
    name = "vision.blocks.0.mlp.w2.weight"  # [D, I] stored; [I, D] is the classic mistake
    tensors = dict(tiny_state, **{name: tiny_state[name].t().contiguous()})
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        load_checkpoint(write_tower(tmp_path / "ckpt", tiny_cfg, tensors))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool])
def test_unsupported_dtype_is_named(tmp_path, tiny_cfg, tiny_state, dtype):
    tensors = dict(tiny_state, **{WEIGHT: torch.zeros(32, 32, dtype=dtype)})
    folder = write_tower(tmp_path / "ckpt", tiny_cfg, tensors)
    with pytest.raises(WeightsError) as info:
        load_checkpoint(folder)
    assert WEIGHT in str(info.value)
    assert str(dtype).removeprefix("torch.") in str(info.value)


def test_fp8_tower_tensor_is_rejected(tmp_path, tiny_cfg, tiny_state):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch has no float8_e4m3fn")
    tensors = dict(tiny_state, **{WEIGHT: tiny_state[WEIGHT].to(torch.float8_e4m3fn)})
    with pytest.raises(WeightsError, match="unsupported dtype"):
        load_checkpoint(write_tower(tmp_path / "ckpt", tiny_cfg, tensors))


@pytest.mark.parametrize("extra", ["vision.blocks.2.norm1.weight", "aligner.w3.weight",
                                   "vision.blocks.0.mlp.w2.bias"])
def test_unexpected_tower_tensor_is_named(tmp_path, tiny_cfg, tiny_state, extra):
    tensors = dict(tiny_state, **{extra: torch.ones(32)})
    with pytest.raises(WeightsError, match=extra.replace(".", r"\.")):
        load_checkpoint(write_tower(tmp_path / "ckpt", tiny_cfg, tensors))


def test_index_naming_a_missing_tower_shard(tmp_path, sharded_ckpt):
    folder = copy_ckpt(sharded_ckpt, tmp_path / "ckpt")
    (folder / SHARD_FILES[1]).unlink()
    with pytest.raises(WeightsError, match="not found"):
        load_checkpoint(folder)


@pytest.mark.parametrize("index", [False, True], ids=["scanned", "indexed"])
def test_a_weights_file_that_is_a_folder_is_named_so(tmp_path, sharded_ckpt, index):
    folder = copy_ckpt(sharded_ckpt, tmp_path / "ckpt")
    if not index:
        (folder / INDEX_NAME).unlink()
    (folder / SHARD_FILES[1]).unlink()
    (folder / SHARD_FILES[1]).mkdir()
    with pytest.raises(WeightsError, match=f"is not a regular file: .*{SHARD_FILES[1]}"):
        load_checkpoint(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="chmod does not stop root from reading")
def test_a_weights_file_that_cannot_be_read_says_so(tmp_path, tiny_ckpt):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    (folder / "model.safetensors").chmod(0)
    with pytest.raises(WeightsError, match="cannot read weights file .*: Permission denied"):
        load_checkpoint(folder)


def test_index_naming_the_wrong_file(tmp_path, tiny_cfg, tiny_state):
    index_extra = {WEIGHT: "other.safetensors"}
    tensors = {n: t for n, t in tiny_state.items() if n != WEIGHT}
    folder = write_checkpoint(tmp_path / "ckpt", tiny_cfg.to_flat(),
                              {"model.safetensors": tensors,
                               "other.safetensors": {"embed.weight": torch.zeros(2)}},
                              index_extra=index_extra)
    with pytest.raises(WeightsError, match=WEIGHT.replace(".", r"\.")):
        load_checkpoint(folder)


def test_corrupt_safetensors_file(tmp_path, tiny_ckpt):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_checkpoint(folder)


def test_corrupt_index(tmp_path, sharded_ckpt):
    folder = copy_ckpt(sharded_ckpt, tmp_path / "ckpt")
    (folder / INDEX_NAME).write_text("{")
    with pytest.raises(WeightsError, match="index"):
        load_checkpoint(folder)


@pytest.mark.parametrize("fname", [None, 3, ["model.safetensors"]])
def test_index_naming_no_file_name_for_a_tensor(tmp_path, sharded_ckpt, fname):
    folder = copy_ckpt(sharded_ckpt, tmp_path / "ckpt")
    index = json.loads((folder / INDEX_NAME).read_text())
    index["weight_map"][WEIGHT] = fname
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=f"index.*{WEIGHT}"):
        load_checkpoint(folder)


# --------------------------------------------------------------------------- folder, config errors

def test_missing_folder(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        load_checkpoint(tmp_path / "nowhere")


def test_path_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match="not a folder"):
        load_checkpoint(tmp_path / "model.safetensors")


def test_missing_config_json(tmp_path, tiny_ckpt):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    (folder / "config.json").unlink()
    with pytest.raises(WeightsError, match="config.json"):
        load_checkpoint(folder)


def test_no_weight_files(tmp_path, tiny_cfg):
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg.to_flat()))
    with pytest.raises(WeightsError, match="safetensors"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("flat_key", ["vision_dim", "hidden_size", "vision_patch_size"])
def test_config_key_missing_is_a_config_error_naming_the_key(tmp_path, tiny_ckpt, nested,
                                                             flat_key):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    flat = json.loads((folder / "config.json").read_text())
    del flat[flat_key]
    raw = nested_layout(flat) if nested else flat
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(folder)
    if nested:
        want = {"vision_dim": "vision_config.hidden_size", "hidden_size": "text_config.hidden_size",
                "vision_patch_size": "vision_config.patch_size"}[flat_key]
    else:
        want = flat_key
    assert want in str(info.value)
    assert "config.json" in str(info.value)
    assert isinstance(info.value, DsvError)


def test_head_dim_not_divisible_by_4_is_a_config_error(tmp_path, tiny_ckpt):
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    flat = json.loads((folder / "config.json").read_text())
    flat.update(vision_dim=20, vision_n_heads=2)  # head dim 10
    (folder / "config.json").write_text(json.dumps(flat))
    with pytest.raises(ConfigError, match="head dim 10"):
        load_checkpoint(folder)


def test_config_that_does_not_match_weights_names_a_tensor(tmp_path, tiny_ckpt):
    """A config with more layers than the weights: the first missing tensor is named."""
    folder = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    flat = json.loads((folder / "config.json").read_text())
    flat["vision_n_layers"] = 3
    (folder / "config.json").write_text(json.dumps(flat))
    with pytest.raises(WeightsError, match=r"vision\.blocks\.2\."):
        load_checkpoint(folder)
