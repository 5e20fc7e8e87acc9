"""The tower's configuration: one dataclass, read from either checkpoint layout."""

from __future__ import annotations

import dataclasses
import json
import math
import stat
from pathlib import Path
from typing import Any, Literal, get_args

from ..errors import ConfigError

#: The attention kernels (``--attention``; ``tower/attention`` picks and checks them), here
#: torch-free so that --help lists them.
Attention = Literal["auto", "flash", "varlen", "sdpa", "grouped"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(Attention)

#: The largest config file read: a config.json is a few kB (a whole model's tens of kB); a
#: larger file, or a device such as /dev/zero, is no config.
MAX_CONFIG_BYTES = 1 << 20

# Official flat key -> (field, nested vision_config key). hidden_size lives in text_config.
_FLAT_TO_FIELD = {
    "vision_n_layers": ("n_layers", "num_hidden_layers"),
    "vision_dim": ("dim", "hidden_size"),
    "vision_n_heads": ("n_heads", "num_attention_heads"),
    "vision_inter_dim": ("inter_dim", "intermediate_size"),
    "vision_patch_size": ("patch_size", "patch_size"),
    "vision_rope_theta": ("rope_theta", "rope_theta"),
    "vision_downsample_ratio": ("downsample_ratio", "downsample_ratio"),
    "vision_max_n_token": ("max_n_token", "max_image_tokens"),
    "vision_min_pixels": ("min_pixels", "min_pixels"),
    "vision_max_wh_ratio": ("max_wh_ratio", "max_wh_ratio"),
}

# The checkpoints dsv4enc encodes for, by config.json ``model_type``. Both have the same
# tower; the image geometry (``tower/transform``) differs, chosen from this, never from sizes.
DEEPSEEK_V4 = "deepseek_v4"
DEEPSEEK_V41 = "deepseek_v41"
MODEL_NAMES = {DEEPSEEK_V4: "DeepSeek-V4", DEEPSEEK_V41: "DeepSeek-V4.1"}

#: The largest value each size may take. DeepSeek-V4(.1)-Flash has 32 layers, width 1024,
#: 16 heads, an MLP of 2816, patches of 14, a 3x3 downsample, 384 (1024) image tokens, a
#: minimum of 147456 (295936) pixels and a hidden size of 4096 (5120): each bound is 30 to
#: 250 times that, generous for any real model, yet the largest tensor they allow (the
#: aligner's, hidden x dim*r^2: 2^16 x 2^26 elements) stays far below what overflows a
#: tensor's byte size (2^63), and a tower past the machine's memory is refused in one line
#: when it is built (``tower/checkpoint``) instead of overflowing torch's size arithmetic.
SIZE_LIMITS = {"n_layers": 1024, "dim": 1 << 16, "n_heads": 4096, "inter_dim": 1 << 18,
               "patch_size": 512, "downsample_ratio": 32, "max_n_token": 1 << 16,
               "min_pixels": 1 << 32, "hidden_size": 1 << 16}


def model_type_of(raw: dict[str, Any]) -> str:
    """The variant a config.json describes: ``deepseek_v41`` when its ``model_type`` says so
    (the top-level one, else a nested layout's sub-configs', e.g. ``deepseek_v41_vision``),
    ``deepseek_v4`` otherwise (older V4 configs carry none)."""
    subs = (raw.get("text_config"), raw.get("vision_config"))
    candidates = [raw.get("model_type")]
    candidates += [sub.get("model_type") for sub in subs if isinstance(sub, dict)]
    for value in candidates:
        if isinstance(value, str) and value:
            is_v41 = value == DEEPSEEK_V41 or value.startswith(DEEPSEEK_V41 + "_")
            return DEEPSEEK_V41 if is_v41 else DEEPSEEK_V4
    return DEEPSEEK_V4


def warn_unknown_vision_keys(raw: dict[str, Any], source: str) -> None:
    """Warn about unknown ``vision_*`` keys, naming the closest known one: a misspelled
    optional key (``vision_max_wh_ratio``) would otherwise silently be absent."""
    import difflib
    import logging

    for key in sorted(k for k in raw if isinstance(k, str) and k.startswith("vision_")):
        if key in _FLAT_TO_FIELD:
            continue
        close = difflib.get_close_matches(key, list(_FLAT_TO_FIELD), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        logging.getLogger("dsv4enc").warning("%s: unknown key %r is ignored%s", source, key, hint)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Settings of the ViT, the aligner and the image transform."""

    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_n_token: int
    min_pixels: int
    max_wh_ratio: float | None
    hidden_size: int
    model_type: str = DEEPSEEK_V4  # picks the image geometry (tower/transform)

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "n_heads", "inter_dim", "patch_size",
                     "downsample_ratio", "max_n_token", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config: {name} must be a positive integer, got {value!r}")
        for name, limit in SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                raise ConfigError(f"config: {name} {getattr(self, name)} is over {limit}, "
                                  "the most dsv4enc takes (a real tower's is far smaller)")
        if self.dim % self.n_heads:
            raise ConfigError(f"config: vision dim {self.dim} is not divisible by "
                              f"n_heads {self.n_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"config: head dim {self.head_dim} (dim/n_heads) is not "
                              "divisible by 4, which 2D RoPE needs")
        if self.max_n_token <= 5:
            raise ConfigError(f"config: max image tokens {self.max_n_token} is too small")
        if self.min_pixels < 0:
            raise ConfigError(f"config: min_pixels {self.min_pixels} is negative")
        for name in ("rope_theta", "max_wh_ratio"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"config: {name} {value} must be a finite positive number")
        if self.model_type not in MODEL_NAMES:
            raise ConfigError(f"config: model_type {self.model_type!r} is not one of "
                              f"{', '.join(MODEL_NAMES)}")

    @property
    def is_v41(self) -> bool:
        """DeepSeek-V4.1 image geometry (else V4's)."""
        return self.model_type == DEEPSEEK_V41

    @property
    def model_name(self) -> str:
        """The variant in words, for help, logs and ``inspect``."""
        return MODEL_NAMES[self.model_type]

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Angles per token: half the head dim (row half, column half)."""
        return self.head_dim // 2

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    def output_width(self, features: str) -> int:
        """Width of one embedding row for ``features`` ("aligner" or "vit")."""
        return self.hidden_size if features == "aligner" else self.dim

    def to_flat(self) -> dict[str, Any]:
        """The official flat layout, as written in config.json (``model_type`` first)."""
        sizes = {flat: getattr(self, field) for flat, (field, _) in _FLAT_TO_FIELD.items()}
        return {"model_type": self.model_type, **sizes, "hidden_size": self.hidden_size}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "VisionConfig":
        """Parse the flat official layout or the nested vision_config/text_config one."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        # Each field's (object it is read from, key there, name in an error message).
        nested = raw.get("vision_config")
        if isinstance(nested, dict) and not any(k in raw for k in _FLAT_TO_FIELD):
            text = raw.get("text_config")
            text = text if isinstance(text, dict) else {}
            where = {field: (nested, key, f"vision_config.{key}")
                     for field, key in _FLAT_TO_FIELD.values()}
            where["hidden_size"] = (text if "hidden_size" in text else raw, "hidden_size",
                                    "text_config.hidden_size")
        else:
            where = {field: (raw, flat, flat) for flat, (field, _) in _FLAT_TO_FIELD.items()}
            where["hidden_size"] = (raw, "hidden_size", "hidden_size")
            warn_unknown_vision_keys(raw, source)
        values = {field: src[key] for field, (src, key, _) in where.items() if key in src}
        names = {field: name for field, (_, _, name) in where.items()}
        values["model_type"] = model_type_of(raw)
        values.setdefault("max_wh_ratio", None)  # the one optional key
        missing = [names[f.name] for f in dataclasses.fields(cls) if f.name not in values]
        if missing:
            raise ConfigError(f"{source}: missing key {', '.join(missing)}")
        try:
            values["rope_theta"] = float(values["rope_theta"])
            if values["max_wh_ratio"] is not None:
                values["max_wh_ratio"] = float(values["max_wh_ratio"])
            values["min_pixels"] = int(values["min_pixels"])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"{source}: bad value ({exc})") from None
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {str(exc).removeprefix('config: ')}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "VisionConfig":
        """Read a config.json (either layout)."""
        path = Path(path)
        try:
            raw = json.loads(_config_bytes(path))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        return cls.from_dict(raw, source=str(path))


def _config_bytes(path: Path) -> bytes:
    """The bytes of ``path``, a regular file of at most ``MAX_CONFIG_BYTES`` (else a
    ConfigError: reading a device or a huge file by mistake would never end)."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise ConfigError(f"cannot read config {path}: not a regular file (a config.json is)")
    with path.open("rb") as handle:
        data = handle.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"cannot read config {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, "
                          "which no config.json is")
    return data
