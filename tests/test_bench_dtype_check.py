"""dsv4enc bench --dtype-check: both dtypes' matmul rates, the CPU's kind, what auto picks."""

import json

import pytest
import torch
from typer.testing import CliRunner

from dsv4enc.bench import dtype_check
from dsv4enc.bench.dtype_check import DtypeCheck, check_dtypes, check_lines, matmul_rates
from dsv4enc.cli import app
from dsv4enc.engine import cpufeatures
from dsv4enc.engine.cpufeatures import PIN_VARIABLE, auto_cpu_dtype

SMALL = (128, 128, 128)  # the logic, not the machine's speed


@pytest.fixture
def zen4(monkeypatch, tmp_path):
    """This process on a faked AMD Zen 4 (family 25 model 17, AVX512-BF16), auto unpinned."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "model\t\t: 17\nflags\t\t: avx512f avx512_bf16\n\n")
    monkeypatch.setattr(cpufeatures, "CPUINFO", str(info))
    monkeypatch.setattr(cpufeatures, "cpu_capabilities",
                        lambda: {"amx_bf16": False, "avx512_bf16": True})
    monkeypatch.setattr(cpufeatures, "kernel_level", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv(PIN_VARIABLE, raising=False)
    auto_cpu_dtype.cache_clear()
    yield
    auto_cpu_dtype.cache_clear()


def test_matmul_rates_interleave_both_dtypes():
    rates = matmul_rates(3, 1, SMALL)
    assert rates["shape"] == "128x128 @ 128x128"
    assert [len(v) for v in rates["gflop_s"].values()] == [3, 3]
    assert all(rate > 0 for v in rates["gflop_s"].values() for rate in v)
    assert rates["bf16_over_fp32"] > 0


def test_the_check_names_the_kind_and_auto_choice(zen4):
    check = check_dtypes(2, 1, SMALL)
    assert check.cpu == "AuthenticAMD family 25 model 17"
    assert check.auto == check.table == "bfloat16"
    assert check.why == "bfloat16 measured 2.9x faster on this AMD Zen 4 CPU"
    text = "\n".join(check_lines(check))
    assert "CPU kind: AuthenticAMD family 25 model 17; bf16 features: avx512_bf16" in text
    assert "--dtype auto picks bfloat16: bfloat16 measured 2.9x faster" in text
    assert check.threads == torch.get_num_threads()


def _check(ratio: float, auto: str = "float32", table: str = "float32") -> DtypeCheck:
    return DtypeCheck("1x1 @ 1x1", 2, 100.0, 100.0 * ratio, ratio, "AuthenticAMD family 27",
                      {"amx_bf16": False, "avx512_bf16": True}, "AVX512", auto, "why", table)


def test_advice_only_where_the_measurement_disagrees_with_auto():
    """An unmeasured kind whose bfloat16 ran 3x as fast is told how to use it; a ratio
    within CLEAR_WIN calls for float32, as the table's own rule does."""
    faster = check_lines(_check(3.0))
    assert faster[-1].startswith("measured here, bfloat16 is the faster dtype: pass --dtype "
                                 f"bfloat16, or set {PIN_VARIABLE}=bfloat16")
    for ratio in (1.1, 0.5):
        assert not any("measured here" in line for line in check_lines(_check(ratio)))
    assert "measured here, float32" in check_lines(_check(0.5, "bfloat16", "bfloat16"))[-1]
    pinned = check_lines(_check(3.0, "float32", "bfloat16"))
    assert f"without {PIN_VARIABLE}, auto would pick bfloat16 here" in pinned


def test_the_command_prints_and_writes_json(zen4, monkeypatch, tmp_path):
    monkeypatch.setattr(dtype_check, "MATMUL_SHAPE", SMALL)
    report = tmp_path / "check.json"
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, ["bench", "--dtype-check", "--threads", "1",
                                          "--json", str(report)])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "float32:" in result.output and "bfloat16:" in result.output
    assert "GFLOP/s (128x128 @ 128x128, 1 thread," in result.output
    assert "--dtype auto picks bfloat16: bfloat16 measured 2.9x faster on this AMD Zen 4 CPU" \
        in result.output
    data = json.loads(report.read_text())
    assert data["cpu"] == "AuthenticAMD family 25 model 17" and data["auto"] == "bfloat16"
    assert data["float32_gflop_s"] > 0 and data["bfloat16_gflop_s"] > 0
    assert data["faster_here"] in ("float32", "bfloat16")


def test_bench_without_config_is_one_line():
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 2
    assert "bench needs --config (or --dtype-check)" in result.output
    assert "Traceback" not in result.output


def test_a_bad_pin_is_one_line(monkeypatch):
    monkeypatch.setenv(PIN_VARIABLE, "float64")
    monkeypatch.setattr(dtype_check, "MATMUL_SHAPE", SMALL)
    auto_cpu_dtype.cache_clear()
    try:
        result = CliRunner().invoke(app, ["bench", "--dtype-check"])
    finally:
        auto_cpu_dtype.cache_clear()
    assert result.exit_code == 2 and PIN_VARIABLE in result.output
    assert "Traceback" not in result.output
