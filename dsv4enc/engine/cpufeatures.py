"""Whether this CPU computes bfloat16 natively, for ``--dtype auto`` on the CPU.

CPUs with AMX (Sapphire Rapids and later) or AVX512-BF16 (Cooper Lake, Zen 4 and later) run
bfloat16 matmuls natively; elsewhere torch emulates bfloat16 by converting to float32 and
back, which is slower than float32 itself. So ``auto`` is bfloat16 exactly when torch reports
one of those features *and* the process lets torch's kernels use it (``ATEN_CPU_CAPABILITY``
and ``ONEDNN_MAX_CPU_ISA`` can cap them below AVX-512); float32 otherwise.

The decision reads what the CPU *is*, never how fast it is right now: no timing, so the
answer is the same in every process on one machine, idle or loaded (a run that is resumed
must compute in the dtype it started with). It is made once per process.

``choose_cpu_dtype`` is the decision itself, with its inputs injected (testable anywhere);
``auto_cpu_dtype`` feeds it this machine's answers and ``auto_cpu_reason`` says why, in words.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import UsageError

log = logging.getLogger(__name__)

#: The features that make bfloat16 native: AMX tiles with bf16, or AVX512 bf16 dot products.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")
#: ``torch.backends.cpu.get_cpu_capability()`` answers under which ATen's kernels may use
#: AVX-512 (and so the bf16 instructions); "AVX2", "DEFAULT" and the like rule them out.
BF16_KERNEL_LEVELS = ("AVX512", "AMX")
#: oneDNN instruction sets (``ONEDNN_MAX_CPU_ISA``) that stop below AVX512-BF16: under such a
#: cap oneDNN's matmuls emulate bfloat16.
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2",
                            "AVX512_CORE", "AVX512_CORE_VNNI")


@dataclass(frozen=True)
class CpuAnswers:
    """What torch and the environment say about this CPU: the inputs of the decision."""

    features: Mapping[str, bool]  # NATIVE_BF16_FEATURES -> present
    kernel_level: str  # torch.backends.cpu.get_cpu_capability(), e.g. "AVX512", "AVX2"
    onednn_max_isa: str = ""  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), "" when unset


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


def kernel_level() -> str:
    """The instruction level ATen dispatches its CPU kernels at ("AVX512", "AVX2", ...);
    "" when this torch cannot say (then only the features decide)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # noqa: BLE001 - older torch: not known
        return ""


def machine_answers() -> CpuAnswers:
    """This process's ``CpuAnswers``: torch's feature queries and kernel level, and the
    oneDNN cap from the environment."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return CpuAnswers(cpu_capabilities(), kernel_level(), isa.strip().upper())


def bf16_blocker(answers: CpuAnswers) -> str | None:
    """Why bfloat16 is not native here, in words; None when it is."""
    if not any(answers.features.get(name, False) for name in NATIVE_BF16_FEATURES):
        return "no AMX-BF16 or AVX512-BF16 on this CPU"
    if answers.kernel_level and answers.kernel_level not in BF16_KERNEL_LEVELS:
        return f"torch's CPU kernels run at {answers.kernel_level} (ATEN_CPU_CAPABILITY)"
    if answers.onednn_max_isa in ONEDNN_ISAS_WITHOUT_BF16:
        return f"ONEDNN_MAX_CPU_ISA={answers.onednn_max_isa} stops below AVX512-BF16"
    return None


def choose_cpu_dtype(answers: CpuAnswers) -> torch.dtype:
    """bfloat16 when ``answers`` say bfloat16 is native and usable, float32 otherwise."""
    return torch.float32 if bf16_blocker(answers) is not None else torch.bfloat16


#: Pins what ``auto`` means on the CPU (``float32`` or ``bfloat16``), e.g. so that machines
#: with and without native bfloat16 compute the same rows, or for a test suite's references.
PIN_VARIABLE = "DSV4ENC_CPU_AUTO_DTYPE"
_PINNABLE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _pinned() -> torch.dtype | None:
    pinned = os.environ.get(PIN_VARIABLE, "").strip()
    if not pinned:
        return None
    if pinned not in _PINNABLE:
        raise UsageError(f"{PIN_VARIABLE}={pinned!r}: use float32 or bfloat16")
    return _PINNABLE[pinned]


@functools.cache
def auto_cpu_dtype() -> torch.dtype:
    """The compute dtype ``auto`` means on this process's CPU (decided once, then cached):
    ``PIN_VARIABLE`` when set, else ``choose_cpu_dtype`` on this machine's answers."""
    pinned = _pinned()
    return pinned if pinned is not None else choose_cpu_dtype(machine_answers())


def auto_cpu_reason() -> str:
    """Why ``auto`` means what it does on this CPU, for the run's opening line."""
    if _pinned() is not None:
        return f"{PIN_VARIABLE} is set"
    answers = machine_answers()
    blocker = bf16_blocker(answers)
    if blocker is not None:
        return blocker
    native = [name for name in NATIVE_BF16_FEATURES if answers.features.get(name)]
    return "native bfloat16 on this CPU (" + ", ".join(native) + ")"
