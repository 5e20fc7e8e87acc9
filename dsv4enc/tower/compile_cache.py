"""Where torch.compile keeps what it built for the fused tower, so that a repeated run on the
same machine loads its kernels instead of compiling them again.

Inductor keeps its FX graph cache, autotuning results and (on CUDA) Triton kernels under
``$TORCHINDUCTOR_CACHE_DIR`` (on the CPU, ``tower/fusion`` adds its note of the vector ISA
probe there). dsv4enc points it at ``cache_root()/inductor/KEY``, KEY naming the torch
version, the device, the compute dtype and a digest of the tower's config: a new torch, GPU
or config compiles afresh in a folder of its own (inductor's own keys would refuse another's
artifacts too; the folder keeps them apart and easy to delete). A
``TORCHINDUCTOR_CACHE_DIR`` the user set is left alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
from pathlib import Path

import torch

from .config import VisionConfig

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "DSV4ENC_CACHE_DIR"
#: Inductor's cache folder (``torch._inductor`` reads it per compile).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

#: The inductor folders this process chose (a later tower may move them; the user's stay).
_chosen: set[str] = set()


def cache_root() -> Path:
    """``$DSV4ENC_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv4enc``, else ``~/.cache/dsv4enc``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dsv4enc"


def cache_key(cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> str:
    """One folder name per torch version, device model (a GPU's name, or the CPU's architecture
    and ATen's vector level), compute dtype and tower config."""
    model = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}")
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    text = (f"torch{torch.__version__}-{device.type}-{model}-"
            f"{str(dtype).removeprefix('torch.')}-{digest}")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text)


def use_compile_cache(cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> Path | None:
    """Point inductor's cache at this tower's folder before it compiles; the folder, or None
    when the user set ``TORCHINDUCTOR_CACHE_DIR`` (theirs is used as it is)."""
    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if current is not None and current not in _chosen and not _inductor_default(current):
        return None
    try:
        folder = cache_root() / "inductor" / cache_key(cfg, device, dtype)
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as exc:  # a read-only home, or none (no HOME, no passwd
        # entry): compile as before, just not kept
        log.warning("compiled kernels are not kept: %s (set %s)", exc, CACHE_DIR_ENV)
        return None
    os.environ[INDUCTOR_CACHE_ENV] = str(folder.resolve())
    _chosen.add(os.environ[INDUCTOR_CACHE_ENV])
    log.info("compiled kernels kept in %s", folder)
    return folder


def _inductor_default(path: str) -> bool:
    """Whether ``path`` is inductor's default folder, which it writes into the variable at
    its first compile (not the user's choice)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(path) == os.path.abspath(default_cache_dir())
