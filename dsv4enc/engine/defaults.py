"""The engine's defaults that the torch-free early start needs (this module imports nothing)."""

from typing import Literal, get_args

#: What a row holds: the aligner's merged rows or the ViT's per-patch features.
Features = Literal["aligner", "vit"]
FEATURES: tuple[str, ...] = get_args(Features)
DEFAULT_FEATURES: Features = "aligner"
#: How an image's rows are stored: all of them, or their mean.
Pool = Literal["none", "mean"]
POOLS: tuple[str, ...] = get_args(Pool)
DEFAULT_POOL: Pool = "none"

#: Tokens per batch when the caller gives none: enough to fill an H200, a few images on a CPU.
DEFAULT_BATCH_TOKENS = {"cuda": 32768, "cpu": 8192}


def default_batch_tokens(device_type: str) -> int:
    """Patches per packed batch on a device of this kind, when the caller gives none."""
    return DEFAULT_BATCH_TOKENS.get(device_type, DEFAULT_BATCH_TOKENS["cpu"])


#: Whether the elementwise work around the GEMMs is fused (``--fused``) when the caller does not
#: say, by device kind: on CUDA it is faster from the first minute and its compile is cached; on
#: the CPU compiling costs more than a small job gains (benchmarks/RESULTS.md).
FUSED_BY_DEFAULT = {"cuda": True, "cpu": False}


def resolve_fused(fused: bool | None, device_type: str) -> bool:
    """``fused`` as asked, or (None) the default for a device of this kind."""
    return FUSED_BY_DEFAULT.get(device_type, False) if fused is None else fused


#: Where the image transform (resize, pad, patchify, normalize) runs: ``host`` is Pillow in
#: the decode workers; ``device`` is ``tower/resample`` on the engine's device, fed the decoded
#: pixels; ``auto`` picks by device kind (``TRANSFORM_ON_DEVICE``).
Transform = Literal["auto", "host", "device"]
TRANSFORMS: tuple[str, ...] = get_args(Transform)
#: ``auto``'s choice by device kind: on CUDA the transform costs the GPU microseconds and the
#: host its largest share of an image; on the CPU, Pillow is faster than torch's integer ops
#: (benchmarks/RESULTS.md), and the device's cores are the host's anyway.
TRANSFORM_ON_DEVICE = {"cuda": True, "cpu": False}


def transform_on_device(transform: str, device_type: str) -> bool:
    """Whether ``--transform`` (``TRANSFORMS``) puts the transform on a device of this kind."""
    if transform == "auto":
        return TRANSFORM_ON_DEVICE.get(device_type, False)
    return transform == "device"


#: Images per packed batch at most, when the caller gives no limit.
DEFAULT_MAX_IMAGES = 64
