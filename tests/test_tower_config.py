"""Model configuration (SPEC §1): both layouts, shipped configs, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4enc.tower.checkpoint import tower_bytes
from dsv4enc.tower.config import SIZE_LIMITS, VisionConfig
from dsv4enc.errors import ConfigError

from helpers import CONFIGS, NESTED_VISION_KEYS, nested_layout

SHIPPED = ["tiny", "medium", "deepseek-v4-flash"]


def flat_of(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
    cfg = VisionConfig.from_file(CONFIGS / f"{name}.json")
    assert cfg.head_dim * cfg.n_heads == cfg.dim
    assert cfg.head_dim % 4 == 0
    assert cfg.patch_dim == 3 * cfg.patch_size ** 2


def test_flash_config_matches_the_spec_table():
    cfg = VisionConfig.from_file(CONFIGS / "deepseek-v4-flash.json")
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.inter_dim) == (32, 1024, 16, 2816)
    assert (cfg.patch_size, cfg.rope_theta, cfg.downsample_ratio) == (14, 10000.0, 3)
    assert (cfg.max_n_token, cfg.min_pixels, cfg.max_wh_ratio) == (384, 147456, 8.0)
    assert cfg.hidden_size == 4096
    assert cfg.rope_dim == 32


@pytest.mark.parametrize("name", SHIPPED)
def test_nested_layout_equals_flat(name, tmp_path):
    flat = flat_of(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(nested_layout(flat)))
    assert VisionConfig.from_file(path) == VisionConfig.from_dict(flat)


def test_nested_layout_with_extra_keys_of_a_real_converted_config():
    nested = nested_layout(flat_of("deepseek-v4-flash"))
    nested["vision_config"].update(model_type="deepseek_v4_vision", hidden_act="silu")
    nested["text_config"].update(num_hidden_layers=43, vocab_size=129280)
    nested["architectures"] = ["DeepseekV4ForCausalLM"]
    assert VisionConfig.from_dict(nested) == VisionConfig.from_dict(flat_of("deepseek-v4-flash"))


def test_nested_layout_may_keep_hidden_size_at_top_level():
    nested = nested_layout(flat_of("tiny"))
    nested["hidden_size"] = nested.pop("text_config")["hidden_size"]
    assert VisionConfig.from_dict(nested) == VisionConfig.from_dict(flat_of("tiny"))


@pytest.mark.parametrize("text_config", [5, "text", [1], None])
def test_a_text_config_that_is_no_object_is_read_past(text_config):
    nested = nested_layout(flat_of("tiny"))
    nested["hidden_size"] = nested.pop("text_config")["hidden_size"]
    nested["text_config"] = text_config
    assert VisionConfig.from_dict(nested) == VisionConfig.from_dict(flat_of("tiny"))
    del nested["hidden_size"]
    with pytest.raises(ConfigError, match=r"missing key text_config\.hidden_size"):
        VisionConfig.from_dict(nested)


@pytest.mark.parametrize("name", SHIPPED)
def test_to_flat_round_trips(name):
    cfg = VisionConfig.from_dict(flat_of(name))
    assert VisionConfig.from_dict(cfg.to_flat()) == cfg
    assert VisionConfig.from_dict(json.loads(json.dumps(cfg.to_flat()))) == cfg


def test_max_wh_ratio_is_optional():
    flat = flat_of("tiny")
    del flat["vision_max_wh_ratio"]
    assert VisionConfig.from_dict(flat).max_wh_ratio is None
    flat["vision_max_wh_ratio"] = None
    assert VisionConfig.from_dict(flat).max_wh_ratio is None


def test_output_width():
    cfg = VisionConfig.from_dict(flat_of("tiny"))
    assert cfg.output_width("aligner") == cfg.hidden_size
    assert cfg.output_width("vit") == cfg.dim


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("key", sorted(NESTED_VISION_KEYS.keys() - {"vision_max_wh_ratio"})
                         + ["hidden_size"])
def test_missing_flat_key_is_named(key):
    flat = flat_of("tiny")
    del flat[key]
    with pytest.raises(ConfigError, match=f"missing key {key}"):
        VisionConfig.from_dict(flat)


@pytest.mark.parametrize("key", ["vision_n_heads", "hidden_size"])
def test_missing_nested_key_is_named(key):
    flat = flat_of("tiny")
    del flat[key]
    want = ("text_config.hidden_size" if key == "hidden_size"
            else "vision_config.num_attention_heads")
    with pytest.raises(ConfigError, match=want.replace(".", r"\.")):
        VisionConfig.from_dict(nested_layout(flat))


def test_several_missing_keys_are_all_named():
    flat = flat_of("tiny")
    del flat["vision_dim"], flat["vision_inter_dim"]
    with pytest.raises(ConfigError) as info:
        VisionConfig.from_dict(flat)
    assert "vision_dim" in str(info.value) and "vision_inter_dim" in str(info.value)


@pytest.mark.parametrize("dim, heads, match", [(20, 2, "head dim 10"), (30, 4, "not divisible"),
                                               (36, 3, None)])
def test_head_dim_rules(dim, heads, match):
    flat = dict(flat_of("tiny"), vision_dim=dim, vision_n_heads=heads)
    if match is None:
        assert VisionConfig.from_dict(flat).head_dim == dim // heads
    else:
        with pytest.raises(ConfigError, match=match):
            VisionConfig.from_dict(flat)


@pytest.mark.parametrize("key, value", [("vision_n_layers", 0), ("vision_dim", -32),
                                        ("vision_patch_size", 14.5), ("vision_n_heads", True),
                                        ("hidden_size", "24"), ("vision_max_n_token", 5),
                                        ("vision_min_pixels", -1), ("vision_max_wh_ratio", 0),
                                        ("vision_rope_theta", "ten thousand"),
                                        ("vision_rope_theta", 0), ("vision_rope_theta", -1e4),
                                        ("vision_rope_theta", float("nan")),
                                        ("vision_rope_theta", float("inf")),
                                        ("vision_max_wh_ratio", float("nan")),
                                        ("vision_max_wh_ratio", float("inf")),
                                        ("vision_min_pixels", float("inf"))])
def test_bad_values_are_config_errors(key, value):
    flat = dict(flat_of("tiny"), **{key: value})
    with pytest.raises(ConfigError):
        VisionConfig.from_dict(flat, source="cfg.json")


@pytest.mark.parametrize("sizes, named", [
    ({"vision_dim": 320000, "vision_inter_dim": 400000}, "dim 320000"),
    ({"vision_dim": 10 ** 9}, "dim 1000000000"),
    ({"vision_n_layers": 10 ** 6}, "n_layers"), ({"vision_inter_dim": 1 << 19}, "inter_dim"),
    ({"vision_patch_size": 10 ** 5}, "patch_size"), ({"hidden_size": 10 ** 12}, "hidden_size"),
    ({"vision_downsample_ratio": 1000}, "downsample_ratio"),
    ({"vision_max_n_token": 10 ** 9}, "max_n_token"),
    ({"vision_min_pixels": 1 << 40}, "min_pixels")])
def test_sizes_past_any_real_tower_are_config_errors(sizes, named):
    with pytest.raises(ConfigError, match=f"cfg.json: {named}.* is over"):
        VisionConfig.from_dict(dict(flat_of("tiny"), **sizes), source="cfg.json")


def test_the_largest_sizes_taken_keep_torch_s_size_arithmetic():
    """A tower at every bound (but one layer) is valid, and its tensors' sizes are computed
    (on the meta device) without overflow: building it is refused for memory, not crashed."""
    largest = {flat: SIZE_LIMITS[field] for flat, field in [
        ("vision_dim", "dim"), ("vision_n_heads", "n_heads"), ("vision_inter_dim", "inter_dim"),
        ("vision_patch_size", "patch_size"), ("vision_downsample_ratio", "downsample_ratio"),
        ("hidden_size", "hidden_size")]}
    cfg = VisionConfig.from_dict(dict(flat_of("tiny"), vision_n_layers=1, **largest))
    assert tower_bytes(cfg, torch.float32) > 2 ** 40


def test_errors_name_the_source(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(flat_of("tiny"), vision_n_layers=0)))
    with pytest.raises(ConfigError, match="config.json.*n_layers"):
        VisionConfig.from_file(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        VisionConfig.from_file(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json"):
        VisionConfig.from_file(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match="JSON object"):
        VisionConfig.from_file(tmp_path / "list.json")
