"""--dtype auto on the CPU: bfloat16 only where it is native and measured faster."""

import pytest
import torch

from dsv4enc.engine.cpufeatures import (MIN_SPEEDUP, NATIVE_BF16_FEATURES, PIN_VARIABLE,
                                 auto_cpu_dtype, choose_cpu_dtype, cpu_capabilities)
from dsv4enc.engine.device import resolve_dtype
from dsv4enc.errors import UsageError

NONE = {"amx_bf16": False, "avx512_bf16": False}


def timer(fp32_s: float, bf16_s: float):
    """A fake probe: seconds per dtype, and the dtypes it was asked about."""
    asked = []

    def time_gemm(dtype: torch.dtype) -> float:
        asked.append(dtype)
        return {torch.float32: fp32_s, torch.bfloat16: bf16_s}[dtype]

    return time_gemm, asked


def test_no_native_feature_is_float32_without_timing():
    time_gemm, asked = timer(1.0, 0.1)
    assert choose_cpu_dtype(NONE, time_gemm) == torch.float32
    assert choose_cpu_dtype({}, time_gemm) == torch.float32
    assert asked == []  # emulated bf16 is never timed (it is slow)


def test_amx_or_avx512_bf16_measured_faster_is_bfloat16():
    for feature in NATIVE_BF16_FEATURES:
        time_gemm, asked = timer(fp32_s=0.009, bf16_s=0.001)  # ~9x, as on Sapphire Rapids
        assert choose_cpu_dtype({**NONE, feature: True}, time_gemm) == torch.bfloat16
        assert set(asked) == {torch.float32, torch.bfloat16}


def test_native_feature_but_not_clearly_faster_is_float32():
    caps = {**NONE, "amx_bf16": True}
    assert choose_cpu_dtype(caps, timer(1.0, 1.0 / (MIN_SPEEDUP * 0.9))[0]) == torch.float32
    assert choose_cpu_dtype(caps, timer(1.0, 3.0)[0]) == torch.float32  # emulated despite the bit
    assert choose_cpu_dtype(caps, timer(1.0, 1.0 / MIN_SPEEDUP)[0]) == torch.bfloat16
    assert choose_cpu_dtype(caps, timer(1.0, 0.0)[0]) == torch.float32  # a broken timer


def test_real_machine_decision(monkeypatch):
    caps = cpu_capabilities()
    assert set(caps) == set(NATIVE_BF16_FEATURES)
    assert all(isinstance(v, bool) for v in caps.values())
    monkeypatch.delenv(PIN_VARIABLE, raising=False)  # conftest pins auto for the suite
    auto_cpu_dtype.cache_clear()
    try:
        dtype = auto_cpu_dtype()
        assert dtype in (torch.float32, torch.bfloat16)
        if not any(caps.values()):
            assert dtype == torch.float32  # e.g. AVX2-only CPUs
        assert auto_cpu_dtype() is dtype  # decided once per process
    finally:
        auto_cpu_dtype.cache_clear()


@pytest.mark.parametrize("pinned, expected", [("float32", torch.float32),
                                              ("bfloat16", torch.bfloat16)])
def test_the_variable_pins_auto(monkeypatch, pinned, expected):
    monkeypatch.setenv(PIN_VARIABLE, pinned)
    auto_cpu_dtype.cache_clear()
    try:
        assert resolve_dtype("auto", torch.device("cpu")) == expected
        assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
        monkeypatch.setenv(PIN_VARIABLE, "float64")
        auto_cpu_dtype.cache_clear()
        with pytest.raises(UsageError, match=PIN_VARIABLE):
            resolve_dtype("auto", torch.device("cpu"))
    finally:
        auto_cpu_dtype.cache_clear()


def test_older_torch_private_predicates(monkeypatch):
    """Without ``torch.cpu.get_capabilities`` (older torch), or when it fails, the private
    per-feature predicates answer; one that fails or is missing means "no"."""
    def broken():
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", broken, raising=False)
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    assert cpu_capabilities() == {"amx_bf16": True, "avx512_bf16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", broken, raising=False)
    assert cpu_capabilities() == {"amx_bf16": True, "avx512_bf16": False}
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch._C._cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch._C._cpu, "_is_cpu_support_amx_tile", raising=False)
    monkeypatch.delattr(torch._C._cpu, "_is_avx512_bf16_supported", raising=False)
    assert cpu_capabilities() == {"amx_bf16": False, "avx512_bf16": False}
