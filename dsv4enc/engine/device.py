"""Which device and dtypes a run computes in: the one answer for the command line, the
Python API and the benchmark.

``auto`` means CUDA when it is available (this rank's LOCAL_RANK device under torchrun),
and bfloat16 on CUDA; on the CPU bfloat16 where it is native (AMX or AVX512-BF16, confirmed
by a probe GEMM: ``cpufeatures``), float32 elsewhere.
"""

from __future__ import annotations

import torch

from ..tower.checkpoint import COMPUTE_DTYPES
from .cpufeatures import auto_cpu_dtype
from ..errors import UsageError

#: Dtypes an embedding can be returned in (the command line writes float32 or float16).
OUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str | torch.device, dist=None) -> torch.device:
    """The device for ``name`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``); under torchrun
    (``dist``) always the rank's own device. Raises UsageError for anything else."""
    if dist is not None:
        return dist.device
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name} asked for, but CUDA is not available")
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
    """The dtype embeddings are returned in: a name or a ``torch.dtype`` of ``OUT_DTYPES``."""
    if isinstance(name, torch.dtype):
        if name not in OUT_DTYPES.values():
            raise ValueError(f"unsupported out_dtype {name} (float32, float16, bfloat16)")
        return name
    text = str(name).removeprefix("torch.")
    if text not in OUT_DTYPES:
        raise ValueError(f"unsupported out_dtype {name!r} (float32, float16, bfloat16)")
    return OUT_DTYPES[text]
