"""How the engine runs the tower, as one object: the command line's options and the Python
API build an ``EngineSettings``, and ``engine/factory.build_engine`` and ``engine/engine``'s
Engine take it. Torch-free, so that the command line reads its defaults and choices here
before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..errors import check_choice, check_flag, check_positive
from ..tower.config import Attention
from .defaults import (DEFAULT_FEATURES, DEFAULT_MAX_IMAGES, FEATURES, TRANSFORMS, Features,
                       Transform, default_batch_tokens)

#: Each choice setting's values (``EngineSettings.check``, ``--help``); the attention backend
#: is checked where it is chosen (``tower/attention.select_attention``), against these.
CHOICES: dict[str, tuple[str, ...]] = {"features": FEATURES, "transform": TRANSFORMS}


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is asked to do (None: the device's default, resolved by the engine).

    ``features``: the rows an image gives (``defaults.FEATURES``); ``attention``: the backend
    (``tower/config.ATTENTION_BACKENDS``); ``cuda_graphs``: replay captured CUDA graphs;
    ``batch_tokens``/``max_images``: the largest packed batch (``for_device`` fills in
    ``batch_tokens``); ``deterministic``: batch-invariant rows; ``fused``: compiled elementwise
    kernels; ``transform``: where images are resized (``defaults.transform_on_device``).
    A field with a ``help`` in its metadata is an ``encode`` option of its own name too."""

    features: Features = DEFAULT_FEATURES
    attention: Attention = "auto"
    cuda_graphs: bool | None = None
    batch_tokens: int | None = None
    max_images: int = DEFAULT_MAX_IMAGES
    deterministic: bool = True
    fused: bool | None = None
    transform: Transform = "auto"

    def check(self) -> "EngineSettings":
        """These settings, or a ``errors.SettingsError`` naming the first one out of range."""
        for name, allowed in CHOICES.items():
            check_choice(name, getattr(self, name), allowed)
        for name in ("batch_tokens", "max_images"):  # positive when given
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        check_flag("deterministic", self.deterministic)
        for name in ("cuda_graphs", "fused"):  # None: the device's default
            check_flag(name, getattr(self, name), optional=True)
        return self

    def for_device(self, device_type: str) -> "EngineSettings":
        """These settings with ``batch_tokens`` resolved for a device of this kind (the one
        place its default is applied)."""
        if self.batch_tokens is not None:
            return self
        return replace(self, batch_tokens=default_batch_tokens(device_type))


#: The names of ``EngineSettings``' fields.
SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(EngineSettings))
