"""Attention backends: each one equals per-span SDPA, zero-length spans included, and a forced
backend that cannot run is a one-line UsageError."""

from __future__ import annotations

import pytest
import torch

from dsv4enc.tower.attention import (VarlenSpans, available_backends, grouped_attention,
                                    length_groups, naive_sdpa_attention, sdpa_attention,
                                    select_attention)
from dsv4enc.engine.engine import resolve_attention
from dsv4enc.errors import UsageError

from helpers import needs_cuda, rel_err

cuda = needs_cuda

LENGTHS = [17, 1, 64, 33]
WITH_EMPTY = [0, 17, 0, 1, 64, 0, 33, 0, 0]  # empty spans first, between and at the end
# Equal lengths side by side and apart, lengths of their own, empty spans.
GROUPS = [35, 35, 12, 0, 35, 12, 1, 64, 35, 0]


def _qkv(total: int, heads: int = 4, d: int = 32, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, d, generator=gen).to(device=device, dtype=dtype)
            for _ in range(3)]


def _reference(q, k, v, lengths):
    """Softmax attention per span in float64, plain math."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for n in lengths:
        s = slice(start, start + n)
        qs, ks, vs = (t[s].double().cpu().transpose(0, 1) for t in (q, k, v))  # (H, n, d)
        att = torch.softmax(qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        out[s] = (att @ vs).transpose(0, 1)
        start += n
    return out


@pytest.mark.parametrize("fn", [sdpa_attention, naive_sdpa_attention, grouped_attention])
@pytest.mark.parametrize("lengths", [LENGTHS, WITH_EMPTY, GROUPS],
                         ids=["plain", "empty_spans", "groups"])
def test_cpu_attention_matches_reference(fn, lengths):
    q, k, v = _qkv(sum(lengths))
    out = fn(q, k, v, VarlenSpans.from_lengths(lengths, "cpu"))
    assert rel_err(out, _reference(q, k, v, lengths)) < 1e-5


def test_sdpa_zeroes_tokens_outside_every_span():
    q, k, v = _qkv(128)
    spans = VarlenSpans.from_lengths(LENGTHS + [0, 0], "cpu")  # 115 of 128 tokens
    out = sdpa_attention(q, k, v, spans)
    assert (out[115:] == 0).all()
    assert rel_err(out[:115], _reference(q[:115], k[:115], v[:115], LENGTHS)) < 1e-5


@pytest.mark.parametrize("fn", [sdpa_attention, grouped_attention])
def test_host_side_backends_need_host_lengths(fn):
    q, k, v = _qkv(8)
    spans = VarlenSpans(torch.tensor([0, 8], dtype=torch.int32), 8, None)
    with pytest.raises(RuntimeError, match="host-side span lengths"):
        fn(q, k, v, spans)


def test_spans_are_grouped_by_length_in_order():
    assert length_groups(GROUPS) == {35: [0, 35, 82, 194], 12: [70, 117], 1: [129], 64: [130]}
    assert length_groups([0, 0]) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [GROUPS, WITH_EMPTY, [20] * 5],
                         ids=["groups", "empty_spans", "one_group"])
def test_grouped_equals_per_image_sdpa_bit_for_bit(lengths, dtype):
    """Each row in its own place, the same values as the simple path's (the same kernel at the
    same N: the batch only adds independent (image, head) problems)."""
    q, k, v = _qkv(sum(lengths), d=64, dtype=dtype)
    spans = VarlenSpans.from_lengths(lengths, "cpu")
    assert torch.equal(grouped_attention(q, k, v, spans), sdpa_attention(q, k, v, spans))


def test_grouped_rows_of_an_image_alone_equal_its_rows_in_a_batch():
    q, k, v = _qkv(sum(GROUPS), d=64)
    batch = grouped_attention(q, k, v, VarlenSpans.from_lengths(GROUPS, "cpu"))
    for start, n in ((0, 35), (35, 35), (194, 35), (70, 12), (130, 64)):
        alone = grouped_attention(q[start:start + n], k[start:start + n], v[start:start + n],
                                  VarlenSpans.from_lengths([n], "cpu"))
        assert torch.equal(alone, batch[start:start + n])


def test_grouped_keeps_padding_out():
    """Tokens past the spans (a bucket's tail) get zeros, and NaN there reaches no real row."""
    q, k, v = _qkv(256, d=64)
    for t in (q, k, v):
        t[sum(GROUPS):] = float("nan")
    spans = VarlenSpans.from_lengths(GROUPS + [0, 0], "cpu")
    out = grouped_attention(q, k, v, spans)
    real = sum(GROUPS)
    assert (out[real:] == 0).all() and torch.isfinite(out[:real]).all()
    assert torch.equal(out[:real], sdpa_attention(q[:real], k[:real], v[:real],
                                                  VarlenSpans.from_lengths(GROUPS, "cpu")))


def test_cpu_offers_sdpa_only():
    assert available_backends(torch.device("cpu")) == ["sdpa"]
    assert select_attention("auto", "cpu")[0] == "sdpa"
    assert select_attention("grouped", "cpu") == ("grouped", grouped_attention)


@pytest.mark.parametrize("name", ["flash", "varlen"])
def test_forcing_a_cuda_backend_on_cpu_is_a_usage_error(name):
    with pytest.raises(UsageError) as info:
        select_attention(name, "cpu")
    message = str(info.value)
    assert name in message and "\n" not in message


def test_unknown_backend_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown attention backend 'xformers'"):
        select_attention("xformers", "cpu")


def test_flash_kernels_refuse_float32():
    # Checked before any device is touched, so this runs on the CPU too.
    with pytest.raises(UsageError, match="float32"):
        resolve_attention("varlen", torch.device("cuda"), torch.float32)


# ----------------------------------------------------------------------------- CUDA backends

def _cuda_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in available_backends(torch.device("cuda")) if b != "sdpa"]


@cuda
def test_auto_on_cuda_picks_the_fastest_for_the_dtype():
    dev = torch.device("cuda")
    assert resolve_attention("auto", dev, torch.bfloat16)[0] == available_backends(dev)[0]
    assert resolve_attention("auto", dev, torch.float32)[0] == "sdpa"


@cuda
@pytest.mark.parametrize("lengths", [LENGTHS, WITH_EMPTY], ids=["plain", "empty_spans"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backends_equal_sdpa(lengths, dtype):
    backends = _cuda_backends()
    if not backends:
        pytest.skip("no varlen or flash backend in this torch")
    q, k, v = _qkv(sum(lengths), heads=4, d=64, device="cuda", dtype=dtype)
    spans = VarlenSpans.from_lengths(lengths, "cuda")
    want = sdpa_attention(q, k, v, spans)
    ref = _reference(q, k, v, lengths).to("cuda")
    for name in backends:
        _, fn = select_attention(name, "cuda")
        got = fn(q, k, v, spans)
        assert got.shape == want.shape and got.dtype == dtype
        assert rel_err(got, want) < 1e-2, name
        assert rel_err(got, ref) < 1e-2, name


@cuda
def test_cuda_backends_accept_a_worst_case_max_seqlen():
    """Graph replay bakes max_seqlen at the budget and pads cu_seqlens with empty spans."""
    backends = _cuda_backends()
    if not backends:
        pytest.skip("no varlen or flash backend in this torch")
    q, k, v = _qkv(256, d=64, device="cuda", dtype=torch.bfloat16)
    lengths = LENGTHS + [0] * 4  # 115 real tokens of 256
    exact = VarlenSpans.from_lengths(lengths, "cuda")
    loose = VarlenSpans(exact.cu_seqlens, 256, None)
    for name in backends:
        _, fn = select_attention(name, "cuda")
        got = fn(q, k, v, loose)[:115]
        assert rel_err(got, fn(q, k, v, exact)[:115]) < 1e-3, name


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_grouped_equals_sdpa_and_an_image_alone_its_batch_rows(dtype):
    q, k, v = _qkv(sum(GROUPS), d=64, device="cuda", dtype=dtype)
    spans = VarlenSpans.from_lengths(GROUPS, "cuda")
    got = grouped_attention(q, k, v, spans)
    assert rel_err(got, sdpa_attention(q, k, v, spans)) < 1e-2
    assert rel_err(got, _reference(q, k, v, GROUPS).to("cuda")) < 1e-2
    for start, n in ((0, 35), (35, 35), (194, 35), (70, 12)):
        alone = grouped_attention(q[start:start + n], k[start:start + n], v[start:start + n],
                                  VarlenSpans.from_lengths([n], "cuda"))
        assert torch.equal(alone, got[start:start + n])
