"""Whether this CPU computes bfloat16 natively, for ``--dtype auto`` on the CPU.

CPUs with AMX (Sapphire Rapids and later) or AVX512-BF16 run bfloat16 matmuls several times
faster than float32; elsewhere torch emulates bfloat16 by converting to float32 and back,
which is slower than float32 itself. So ``auto`` picks bfloat16 only when torch reports one
of those features *and* a tiny GEMM confirms the speed-up (a feature bit says nothing about
whether this torch build's kernels use it). The decision is made once per process.

``choose_cpu_dtype`` is the decision itself, with its inputs injected (testable anywhere);
``auto_cpu_dtype`` feeds it this machine's capabilities and timings.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, Mapping

import torch

from ..errors import UsageError

log = logging.getLogger(__name__)

#: The features that make bfloat16 native: AMX tiles with bf16, or AVX512 bf16 dot products.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")
#: bfloat16 must beat float32 by this factor on the probe GEMM to be picked.
MIN_SPEEDUP = 1.5
#: The probe GEMM: (M, K) @ (K, N), about 0.27 GFLOP: a few ms in float32 on two cores.
PROBE_SHAPE = (128, 1024, 1024)


def cpu_capabilities() -> dict[str, bool]:
    """torch's view of this CPU's bfloat16 features (``NATIVE_BF16_FEATURES``), by name.

    Recent torch has ``torch.cpu.get_capabilities()``; older releases have one private
    predicate per feature, whose names changed over time (AMX tiles stand in for AMX-BF16
    there: every CPU with one has the other). A torch with none reports no feature."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            caps = get()
            return {name: bool(caps.get(name, False)) for name in NATIVE_BF16_FEATURES}
        except Exception:  # noqa: BLE001 - a query that fails means "not known": float32
            log.debug("torch.cpu.get_capabilities() failed", exc_info=True)
    predicates = {"amx_bf16": ("_is_amx_tile_supported", "_is_cpu_support_amx_tile"),
                  "avx512_bf16": ("_is_avx512_bf16_supported",)}
    return {name: any(_ask(predicate) for predicate in names)
            for name, names in predicates.items()}


def _ask(predicate: str) -> bool:
    """One of torch's private CPU predicates; False when this torch lacks it or it fails."""
    cpu_module = getattr(torch._C, "_cpu", None)
    query = getattr(torch.cpu, predicate, None) or getattr(cpu_module, predicate, None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - not known: not native
        return False


def gemm_seconds(dtype: torch.dtype, shape: tuple[int, int, int] = PROBE_SHAPE,
                 repeat: int = 3) -> float:
    """Best time of one (M, K) @ (K, N) product in ``dtype`` on the CPU, after a warm-up
    (the first call of a oneDNN kernel pays for its creation)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        torch.mm(a, b)
        for _ in range(repeat):
            began = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - began)
    return best


def choose_cpu_dtype(capabilities: Mapping[str, bool],
                     time_gemm: Callable[[torch.dtype], float],
                     min_speedup: float = MIN_SPEEDUP) -> torch.dtype:
    """bfloat16 when ``capabilities`` names a native bf16 feature and ``time_gemm`` (seconds
    of the probe GEMM in a dtype) finds bfloat16 at least ``min_speedup`` times faster than
    float32; float32 otherwise. ``time_gemm`` is not called without such a feature."""
    if not any(capabilities.get(name, False) for name in NATIVE_BF16_FEATURES):
        return torch.float32
    fp32, bf16 = time_gemm(torch.float32), time_gemm(torch.bfloat16)
    return torch.bfloat16 if bf16 > 0 and fp32 / bf16 >= min_speedup else torch.float32


#: Pins what ``auto`` means on the CPU (``float32`` or ``bfloat16``), e.g. so that machines
#: with and without native bfloat16 compute the same rows, or for a test suite's references.
PIN_VARIABLE = "DSV4ENC_CPU_AUTO_DTYPE"
_PINNABLE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.cache
def auto_cpu_dtype() -> torch.dtype:
    """The compute dtype ``auto`` means on this process's CPU (decided once, then cached):
    ``PIN_VARIABLE`` when set, else ``choose_cpu_dtype`` on this machine."""
    pinned = os.environ.get(PIN_VARIABLE, "").strip()
    if pinned:
        if pinned not in _PINNABLE:
            raise UsageError(f"{PIN_VARIABLE}={pinned!r}: use float32 or bfloat16")
        return _PINNABLE[pinned]
    caps = cpu_capabilities()
    try:
        dtype = choose_cpu_dtype(caps, gemm_seconds)
    except Exception:  # noqa: BLE001 - a probe that fails must not stop a run: float32
        log.debug("bfloat16 probe failed; using float32", exc_info=True)
        dtype = torch.float32
    log.info("CPU compute dtype for auto: %s (native bf16 features: %s)",
             str(dtype).removeprefix("torch."),
             ", ".join(name for name, has in caps.items() if has) or "none")
    return dtype
