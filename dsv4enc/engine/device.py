"""Which device and dtypes a run computes in, for the command line, the API and the benchmark:
``auto`` means CUDA when it is available (the rank's own device under torchrun), and bfloat16
on CUDA; on the CPU, the dtype ``cpufeatures`` chooses for this kind of CPU."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..tower.checkpoint import COMPUTE_DTYPES
from .cpufeatures import auto_cpu_dtype
from ..errors import UsageError


def resolve_device(name: str | torch.device,
                   rank_device: torch.device | None = None) -> torch.device:
    """The device for ``name`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``); under torchrun
    always the rank's own device (``rank_device``). Raises UsageError for anything else."""
    if rank_device is not None:
        return rank_device
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name} asked for, but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"device {name} asked for, but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s), cuda:0 onwards")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {name!r} (use auto, cpu, cuda or cuda:N)")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The compute dtype for ``name`` (``auto``, a name, or a ``torch.dtype``) on ``device``.
    An unknown name is a UsageError; an unsupported ``torch.dtype`` a ValueError."""
    if isinstance(name, torch.dtype):
        if name not in COMPUTE_DTYPES.values():
            raise ValueError(f"unsupported compute dtype {name} (float32, bfloat16, float16)")
        return name
    name = str(name).removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else auto_cpu_dtype()
    if name not in COMPUTE_DTYPES:
        raise UsageError(f"unknown dtype {name!r} (use auto, float32, bfloat16 or float16)")
    return COMPUTE_DTYPES[name]


def resolve_out_dtype(name: str | torch.dtype) -> torch.dtype:
    """The dtype embeddings are returned in: a ``COMPUTE_DTYPES`` name or ``torch.dtype``."""
    text = str(name).removeprefix("torch.")  # a torch.dtype's str and repr: "torch.float16"
    if text not in COMPUTE_DTYPES:
        raise ValueError(f"unsupported out_dtype {name!r} (float32, float16, bfloat16)")
    return COMPUTE_DTYPES[text]


def resume_compute(device: torch.device, dtype: torch.dtype, asked_device: str,
                   asked_dtype: str, recorded: Mapping[str, Any] | None,
                   device_fixed: bool = False) -> tuple[torch.device, torch.dtype, str | None]:
    """The device and compute dtype a ``--resume`` computes in, and the line that says so
    (None unless a recorded choice was adopted). Rows must not mix dtypes or device kinds, so
    where asked for ``auto``, the interrupted run's (``recorded``) replace what ``auto`` picks
    now; explicit flags stay, for the settings check to refuse. ``device_fixed``: a torchrun
    rank's own device."""
    if not recorded:
        return device, dtype, None
    adopted = []
    kind = recorded.get("device")
    if (str(asked_device) == "auto" and not device_fixed and kind in ("cpu", "cuda")
            and kind != device.type and (kind == "cpu" or torch.cuda.is_available())):
        device = torch.device(kind)
    if str(asked_device) == "auto" and kind == device.type:
        adopted.append("--device auto")
    name = recorded.get("compute_dtype")
    if str(asked_dtype).removeprefix("torch.") == "auto" and name in COMPUTE_DTYPES:
        dtype = COMPUTE_DTYPES[name]
        adopted.append("--dtype auto")
    if not adopted:
        return device, dtype, None
    shown = str(dtype).removeprefix("torch.")
    return device, dtype, (f"resuming in {shown} on {device.type}, as the interrupted run "
                           f"computed (for {' and '.join(adopted)})")
