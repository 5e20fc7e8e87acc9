"""``dsv4enc bench --dtype-check``: this CPU's float32 and bfloat16 matmul rates, its kind,
and what ``--dtype auto`` picks on it and why.

``--dtype auto`` never times anything (``engine/cpufeatures`` looks the kind up in a table);
this command is how a user finds out whether the table's choice is the faster one here, on a
kind the table does not know above all."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..engine.cpufeatures import (CLEAR_WIN, PIN_VARIABLE, auto_cpu_dtype, auto_cpu_reason,
                                  cpu_decision, machine_answers)

#: The encoder's matmul shape, (M, K, N) of an (M, K) @ (K, N) product: what the table's
#: figures were measured at.
MATMUL_SHAPE = (1024, 4096, 1024)
#: The dtypes compared, by name.
COMPARED = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Seconds the whole check may spend timing: a dtype this CPU runs without native support
#: (bfloat16 under an AVX2-only kernel level) can be 100x slower, and the check still ends.
TIMING_BUDGET_S = 20.0
#: A first product slower than this is timed alone (its repeats would add nothing but time).
SLOW_PRODUCT_S = 1.0


def _gflops(a: torch.Tensor, b: torch.Tensor, repeat: int) -> float:
    """GFLOP/s of ``repeat`` products ``a @ b`` after one more (the first one's own rate when
    it takes over ``SLOW_PRODUCT_S``)."""
    flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    began = time.perf_counter()
    a @ b
    first = time.perf_counter() - began
    if first > SLOW_PRODUCT_S:
        return flop / first / 1e9
    began = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return flop * repeat / (time.perf_counter() - began) / 1e9


def matmul_rates(rounds: int, repeat: int, shape: tuple[int, int, int]) -> dict:
    """float32 and bfloat16 GFLOP/s of an (M, K) @ (K, N) matmul, interleaved round by round
    so that both dtypes see the same machine (fewer rounds past ``TIMING_BUDGET_S``); the
    ratio is of the rounds' medians."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    operands = {name: (torch.randn(m, k, generator=generator).to(dtype),
                       torch.randn(k, n, generator=generator).to(dtype))
                for name, dtype in COMPARED.items()}
    rates: dict[str, list[float]] = {name: [] for name in operands}
    began = time.perf_counter()
    for _ in range(rounds):
        for name, (a, b) in operands.items():
            rates[name].append(_gflops(a, b, repeat))
        if time.perf_counter() - began > TIMING_BUDGET_S:
            break  # at least one round of each
    ratio = statistics.median(rates["bfloat16"]) / statistics.median(rates["float32"])
    shown = {name: [round(rate, 1) for rate in by_round] for name, by_round in rates.items()}
    return {"shape": f"{m}x{k} @ {k}x{n}", "gflop_s": shown, "bf16_over_fp32": float(f"{ratio:.3g}")}


@dataclass
class DtypeCheck:
    """One check: the rates measured here, the CPU's kind, and ``auto``'s choice."""

    shape: str  # "1024x4096 @ 4096x1024"
    threads: int  # torch's intra-op threads during the timing
    float32_gflop_s: float  # the median of the rounds
    bfloat16_gflop_s: float
    bf16_over_fp32: float  # the medians' ratio
    cpu: str  # CpuAnswers.described(): "AuthenticAMD family 25 model 17"
    features: dict[str, bool]  # NATIVE_BF16_FEATURES -> present
    kernel_level: str  # the level torch's CPU kernels run at
    auto: str  # what --dtype auto picks in this process: "float32" or "bfloat16"
    why: str  # auto's reason, as a run's first line gives it
    table: str  # what the table alone picks for this kind (auto unless pinned)

    @property
    def faster_here(self) -> str:
        """The dtype these rates call for, by the table's own rule (``CLEAR_WIN``)."""
        return "bfloat16" if self.bf16_over_fp32 > CLEAR_WIN else "float32"


def check_dtypes(rounds: int = 4, repeat: int = 5,
                 shape: tuple[int, int, int] | None = None) -> DtypeCheck:
    """Time both dtypes (``matmul_rates``) and say what ``auto`` picks here."""
    rates = matmul_rates(rounds, repeat, shape or MATMUL_SHAPE)
    answers = machine_answers()
    table_dtype, _ = cpu_decision(answers)
    return DtypeCheck(
        rates["shape"], torch.get_num_threads(),
        statistics.median(rates["gflop_s"]["float32"]),
        statistics.median(rates["gflop_s"]["bfloat16"]), rates["bf16_over_fp32"],
        answers.described(), dict(answers.features), answers.kernel_level or "unknown",
        str(auto_cpu_dtype()).removeprefix("torch."), auto_cpu_reason(),
        str(table_dtype).removeprefix("torch."))


def check_lines(check: DtypeCheck) -> list[str]:
    """The check in words, one fact a line, ending with advice where the rates measured here
    call for the other dtype than ``auto``'s."""
    shown = ", ".join(name for name, present in check.features.items() if present) or "none"
    lines = [f"CPU kind: {check.cpu}; bf16 features: {shown}; torch kernels: "
             f"{check.kernel_level}",
             f"float32:  {check.float32_gflop_s:8.1f} GFLOP/s ({check.shape}, "
             f"{check.threads} thread{'s' if check.threads != 1 else ''}, median of interleaved "
             "rounds)",
             f"bfloat16: {check.bfloat16_gflop_s:8.1f} GFLOP/s "
             f"({check.bf16_over_fp32:g}x float32's rate)",
             f"--dtype auto picks {check.auto}: {check.why}"]
    if check.table != check.auto:
        lines.append(f"without {PIN_VARIABLE}, auto would pick {check.table} here")
    if check.faster_here != check.auto:
        lines.append(f"measured here, {check.faster_here} is the faster dtype: pass --dtype "
                     f"{check.faster_here}, or set {PIN_VARIABLE}={check.faster_here} "
                     "(a busy machine can mislead: check again when it is idle)")
    return lines


def dtype_check_command(json_out: str | None = None) -> DtypeCheck:
    """``dsv4enc bench --dtype-check``: check, print ``check_lines``, and write the check as
    JSON to ``json_out`` when given."""
    import json

    check = check_dtypes()
    print("\n".join(check_lines(check)))
    if json_out:
        with open(json_out, "w") as handle:
            json.dump({**asdict(check), "faster_here": check.faster_here}, handle, indent=1)
    return check
