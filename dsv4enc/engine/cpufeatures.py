"""Which compute dtype ``--dtype auto`` means on the CPU: the faster one on this kind of CPU.

Having bfloat16 instructions is not enough for bfloat16 to be faster, so ``auto`` looks this
CPU's kind up in ``MEASURED_KINDS`` (``benchmarks/cpu_dtype_rate.py --matmul`` measured them)
and picks bfloat16 only where it is more than ``CLEAR_WIN`` times faster; anywhere else, and
where torch emulates bfloat16, float32. A CPU's kind is its vendor, family and bfloat16
features, less those the process forbids torch's kernels (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``). Nothing is timed, so every process on one machine, idle or loaded,
makes the same choice (a resumed run must compute in the dtype it started with)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import UsageError

log = logging.getLogger(__name__)

#: The features that can make bfloat16 native: AMX tiles with bf16, or AVX512 bf16 dot products.
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16")
#: ``torch.backends.cpu.get_cpu_capability()`` answers under which ATen's kernels may use
#: AVX-512 (and so the bf16 instructions); "AVX2", "DEFAULT" and the like rule them out.
BF16_KERNEL_LEVELS = ("AVX512", "AMX")
#: oneDNN instruction sets (``ONEDNN_MAX_CPU_ISA``) that stop below AVX512-BF16: under such a
#: cap oneDNN's matmuls emulate bfloat16.
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2",
                            "AVX512_CORE", "AVX512_CORE_VNNI")
#: oneDNN instruction sets that stop below AMX: bfloat16 runs on AVX512-BF16 alone there.
ONEDNN_ISAS_WITHOUT_AMX = ONEDNN_ISAS_WITHOUT_BF16 + ("AVX512_CORE_BF16", "AVX512_CORE_FP16",
                                                      "AVX10_1_512")
#: Where the two dtypes' matmul rates are within this factor, float32 is chosen.
CLEAR_WIN = 1.2


@dataclass(frozen=True)
class CpuKind:
    """A kind of CPU whose float32 and bfloat16 matmul rates were measured."""

    where: str  # for the opening line: "with AMX on this Intel CPU"
    vendor: str  # CpuAnswers.vendor: "GenuineIntel", "AuthenticAMD"
    needs: tuple[str, ...]  # usable NATIVE_BF16_FEATURES that must be present
    bf16_speedup: float  # measured bfloat16 matmul rate over float32's
    lacks: tuple[str, ...] = ()  # usable NATIVE_BF16_FEATURES that must be absent
    families: tuple[int, ...] = ()  # cpuid families; () for any

    def matches(self, answers: "CpuAnswers", usable: set[str]) -> bool:
        return (answers.vendor == self.vendor and usable.issuperset(self.needs)
                and not usable.intersection(self.lacks)
                and (not self.families or answers.family in self.families))


#: The measured kinds, first match wins (RESULTS.md, "--dtype auto on the CPU: the measured
#: kinds"). Intel kinds are told apart by AMX, not by model number: hypervisors report other
#: models, and hide AMX from some guests of AMX hardware. AMD kinds are told apart by family,
#: and an AMD family not listed is not measured (float32), although both measured ones run
#: bfloat16 about 3x as fast: on Intel the same AVX512-BF16 flag ran it at 0.58x, so a flag
#: alone is no measurement.
MEASURED_KINDS = (
    CpuKind("with AMX on this Intel CPU", "GenuineIntel", ("amx_bf16",), bf16_speedup=5.4),
    CpuKind("without AMX on this Intel CPU", "GenuineIntel", ("avx512_bf16",),
            bf16_speedup=0.58, lacks=("amx_bf16",)),
    CpuKind("on this AMD Zen 5 CPU", "AuthenticAMD", ("avx512_bf16",), bf16_speedup=3.6,
            families=(26,)),
    # Family 25 is Zen 3 and Zen 4; of the two, only Zen 4 has AVX512-BF16.
    CpuKind("on this AMD Zen 4 CPU", "AuthenticAMD", ("avx512_bf16",), bf16_speedup=2.9,
            families=(25,)),
)
#: What a kind not in ``MEASURED_KINDS`` is told, so that it can measure itself.
CHECK_COMMAND = "dsv4enc bench --dtype-check"


@dataclass(frozen=True)
class CpuAnswers:
    """What torch, the OS and the environment say about this CPU: the decision's inputs."""

    features: Mapping[str, bool]  # NATIVE_BF16_FEATURES -> present
    kernel_level: str  # torch.backends.cpu.get_cpu_capability(), e.g. "AVX512", "AVX2"
    onednn_max_isa: str = ""  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), "" when unset
    vendor: str = ""  # cpuid's vendor: "GenuineIntel", "AuthenticAMD"; "" when not known
    family: int = 0  # cpuid's family (6: Intel Core and Xeon; 25: Zen 3/4; 26: Zen 5)
    model: int = 0  # cpuid's model, as the OS (or a hypervisor) reports it

    def described(self) -> str:
        """``GenuineIntel family 6 model 167``: the kind, for a line a user can report."""
        return f"{self.vendor or 'unknown vendor'} family {self.family} model {self.model}"


def cpu_capabilities() -> dict[str, bool]:
    """torch's view of this CPU's ``NATIVE_BF16_FEATURES``: ``torch.cpu.get_capabilities()``,
    else a private predicate per feature (AMX tiles stand in for AMX-BF16: CPUs have both)."""
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
        return query is not None and bool(query())
    except Exception:  # noqa: BLE001 - not known: not native
        return False


def kernel_level() -> str:
    """The level ATen dispatches its CPU kernels at ("AVX512", "AVX2", ...); "" when unknown."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # noqa: BLE001 - older torch: not known
        return ""


#: Where Linux describes the CPU (a test points it at a fake one).
CPUINFO = "/proc/cpuinfo"


def cpu_identity() -> tuple[str, int, int]:
    """This CPU's vendor, family and model as the OS reports them (``CPUINFO``, Windows'
    processor string); ``("", 0, 0)``, which no measured kind matches, where it does not say."""
    fields: dict[str, str] = {}
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as info:
            for line in itertools.takewhile(str.strip, info):  # the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # Windows: "Intel64 Family 6 Model 167 Stepping 1, GenuineIntel"
        found = re.search(r"Family (\d+) Model (\d+).*, *(\w+)", platform.processor() or "")
        return (found[3], int(found[1]), int(found[2])) if found else ("", 0, 0)
    return (fields.get("vendor_id", ""), _number(fields.get("cpu family")),
            _number(fields.get("model")))


def _number(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def machine_answers() -> CpuAnswers:
    """This process's ``CpuAnswers``: torch's queries, the oneDNN cap, the OS's CPU identity."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return CpuAnswers(cpu_capabilities(), kernel_level(), isa.strip().upper(), *cpu_identity())


def bf16_blocker(answers: CpuAnswers) -> str | None:
    """Why bfloat16 is emulated here, in words; None when torch may run it natively."""
    if not any(answers.features.get(name, False) for name in NATIVE_BF16_FEATURES):
        return "bfloat16 is emulated without AMX-BF16 or AVX512-BF16 on this CPU"
    if answers.kernel_level and answers.kernel_level not in BF16_KERNEL_LEVELS:
        return f"torch's CPU kernels run at {answers.kernel_level} (ATEN_CPU_CAPABILITY)"
    if answers.onednn_max_isa in ONEDNN_ISAS_WITHOUT_BF16:
        return f"ONEDNN_MAX_CPU_ISA={answers.onednn_max_isa} stops below AVX512-BF16"
    return None


def cpu_decision(answers: CpuAnswers,
                 kinds: tuple[CpuKind, ...] = MEASURED_KINDS) -> tuple[torch.dtype, str]:
    """The compute dtype ``answers`` call for, and why in words: bfloat16 where this CPU's
    measured kind runs it more than ``CLEAR_WIN`` times faster than float32, else float32."""
    blocker = bf16_blocker(answers)
    if blocker is not None:
        return torch.float32, blocker
    usable = {name for name in NATIVE_BF16_FEATURES if answers.features.get(name, False)}
    if answers.onednn_max_isa in ONEDNN_ISAS_WITHOUT_AMX:
        usable.discard("amx_bf16")  # the features this process's kernels may use
    kind = next((kind for kind in kinds if kind.matches(answers, usable)), None)
    if kind is None:
        shown = ", ".join(sorted(usable)) or "no usable bf16 feature"
        return torch.float32, (f"bfloat16 is not measured on this CPU kind "
                               f"({answers.described()}, {shown}; {CHECK_COMMAND} times both)")
    if kind.bf16_speedup > CLEAR_WIN:
        return torch.bfloat16, f"bfloat16 measured {kind.bf16_speedup:g}x faster {kind.where}"
    if kind.bf16_speedup < 1:
        return torch.float32, f"bfloat16 is slower {kind.where}"
    return torch.float32, f"bfloat16 is within {CLEAR_WIN:g}x of float32 {kind.where}"


def choose_cpu_dtype(answers: CpuAnswers) -> torch.dtype:
    """The compute dtype ``auto`` means for ``answers`` (``cpu_decision``'s dtype)."""
    return cpu_decision(answers)[0]


#: Pins what ``auto`` means on the CPU (``float32`` or ``bfloat16``), e.g. so that machines
#: of different kinds compute the same rows, or for a test suite's references.
PIN_VARIABLE = "DSV4ENC_CPU_AUTO_DTYPE"
_PINNABLE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _pinned() -> torch.dtype | None:
    pinned = os.environ.get(PIN_VARIABLE, "").strip()
    if pinned and pinned not in _PINNABLE:
        raise UsageError(f"{PIN_VARIABLE}={pinned!r}: use float32 or bfloat16")
    return _PINNABLE.get(pinned)


@functools.cache
def auto_cpu_dtype() -> torch.dtype:
    """The compute dtype ``auto`` means on this process's CPU (decided once, then cached):
    ``PIN_VARIABLE`` when set, else ``choose_cpu_dtype`` on this machine's answers."""
    return _pinned() or choose_cpu_dtype(machine_answers())


def auto_cpu_reason() -> str:
    """Why ``auto`` means what it does on this CPU, for the run's opening line."""
    if _pinned() is not None:
        return f"{PIN_VARIABLE} is set"
    return cpu_decision(machine_answers())[1]
