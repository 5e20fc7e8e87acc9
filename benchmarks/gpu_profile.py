"""Where a real-dims forward spends its device time, and how fast each attention kernel is.

    PYTHONPATH=. python benchmarks/gpu_profile.py --json prof.json      # on a GPU machine
    PYTHONPATH=. python benchmarks/gpu_profile.py --device cpu --config configs/tiny.json

Two sections, one process:

- ``breakdown``: one packed batch of equal 1024x768-photo grids (47x63 patches) through the
  engine, eager and ``--fused``, under ``torch.profiler``. Device kernel time is split into
  GEMM, attention and the rest (norms, RoPE, adds, activation, copies), and each class's
  achieved TFLOP/s is reported against the FLOPs counted analytically.
- ``elementwise``: RMSNorm, add + RMSNorm, RoPE and SwiGLU at a full batch's shape, eager and
  compiled (shape-generic and shape-specialized kernels), in GB/s moved.
- ``attention``: the same q, k, v through every attention kernel this torch offers: each
  ``--attention`` choice side by side (the packed ``varlen`` kernel, ``grouped``: one batched
  SDPA per length, ``sdpa``: SDPA per image), and ``scaled_dot_product_attention`` on a
  (B, H, N, d) batch with each SDPA backend forced (flash, cuDNN, memory-efficient). Equal
  lengths (most photos land on one canvas), then ``--mixed`` lengths for the engine's
  choices. Each batched candidate also reports whether image 0 alone gives other values.

``--attention auto,grouped``: the attention choices the breakdown and fused sections run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from dsv4enc.tower.attention import (VarlenSpans, available_backends, grouped_attention,
                                    select_attention)
from dsv4enc.bench.throughput import best_time, sync
from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.engine.engine import Engine
from dsv4enc.engine.packing import pack
from dsv4enc.run.plan import image_flops
from dsv4enc.tower.transform import plan_canvas

ROWS: list[dict] = []


def kernel_class(name: str) -> str:
    """GEMM, attention or other, from a CUDA (or CPU) kernel's name."""
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "attn", "cudnn_generated")):
        return "attention"
    if low in ("aten::mm", "aten::addmm", "aten::bmm") or any(
            k in low for k in ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "cublas")):
        return "gemm"
    return "other"


def equal_batch(cfg: VisionConfig, n_images: int, seed: int = 0):
    """``n_images`` random images on the 1024x768 photo grid, packed."""
    canvas = plan_canvas(1024, 768, cfg)
    gen = torch.Generator().manual_seed(seed)
    items = [(torch.randn(canvas.n_patches, cfg.patch_dim, generator=gen).to(torch.bfloat16),
              canvas.n_h, canvas.n_w) for _ in range(n_images)]
    return pack(items, cfg.downsample_ratio), canvas


def breakdown(cfg: VisionConfig, device: torch.device, dtype: torch.dtype, n_images: int,
              fused: bool, attention: str = "auto") -> None:
    from torch.profiler import ProfilerActivity, profile

    model = build_tower(random_checkpoint(cfg, 0, dtype), device)
    if fused:
        from dsv4enc.engine.engine import runs_one_shape
        from dsv4enc.tower.fusion import fuse_elementwise

        fuse_elementwise(model, dynamic=not runs_one_shape(model, True))
    batch, canvas = equal_batch(cfg, n_images)
    engine = Engine(model, "aligner", attention, torch.float16, cuda_graphs=False,
                    batch_tokens=batch.n_tokens, max_images=n_images)
    engine.prepare()
    wall = best_time(lambda: engine.encode(batch), device, repeat=3, warmup=2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        engine.encode(batch)
        sync(device)
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if device.type == "cuda":  # kernels
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.time_range.elapsed_us()
        else:  # aten ops' own time (children excluded, so nothing counts twice)
            if not event.name.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        per_class[kernel_class(event.name)] += us
        per_kernel[event.name] += us
    N, D, I, L = canvas.n_patches, cfg.dim, cfg.inter_dim, cfg.n_layers
    attn_flops = n_images * L * 4.0 * N * N * D
    total_flops = n_images * image_flops(cfg, canvas.n_h, canvas.n_w)
    flops = {"attention": attn_flops, "gemm": total_flops - attn_flops, "other": 0.0}
    busy = sum(per_class.values()) / 1e6
    tag = f"{'fused' if fused else 'eager'} {engine.attention_name}"
    print(f"--- breakdown {tag}: {n_images} images x {N} patches, wall {wall * 1e3:.1f} ms "
          f"({n_images / wall:.1f} img/s, {total_flops / wall / 1e12:.1f} TFLOP/s), "
          f"kernels {busy * 1e3:.1f} ms")
    row = {"section": "breakdown", "variant": tag, "images": n_images, "wall_s": wall,
           "img_s": n_images / wall, "tflop_s": total_flops / wall / 1e12, "kernels_s": busy}
    for cls in ("gemm", "attention", "other"):
        s = per_class[cls] / 1e6
        rate = flops[cls] / s / 1e12 if s and flops[cls] else None
        print(f"  {cls:9s} {s * 1e3:8.1f} ms  {s / max(busy, 1e-12):6.1%}"
              + (f"  {rate:6.1f} TFLOP/s" if rate else ""))
        row[f"{cls}_s"] = s
        row[f"{cls}_tflop_s"] = rate
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    for name, us in top:
        print(f"    {us / 1e3:8.2f} ms  {kernel_class(name):9s} {name[:110]}")
    row["top"] = [(name[:200], us / 1e6) for name, us in top]
    ROWS.append(row)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fn_first_alone(name: str, candidates: dict, qb, kb, vb, out) -> int | None:
    """For a batched candidate (SDPA on (B, H, N, d), ``grouped``): how many of image 0's
    output values change when it is the only image in the call (None for the others)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = qb.shape[2]
    if name.startswith("grouped"):
        q0, k0, v0 = (t[0].transpose(0, 1) for t in (qb, kb, vb))  # (N, H, d)
        alone = grouped_attention(q0, k0, v0, VarlenSpans.from_lengths([n], q0.device))
        return int((alone != out[:n]).sum())
    if not name.startswith("sdpa ") or "(B, H, N, d)" not in name:
        return None
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": getattr(SDPBackend,
               "CUDNN_ATTENTION", None), "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH}[name.split()[1]]
    with sdpa_kernel([backend]):
        alone = F.scaled_dot_product_attention(qb[:1], kb[:1], vb[:1])
    first = out[:n].view(n, *alone.shape[1:2], alone.shape[3])  # (N, H, d) rows of image 0
    return int((alone[0].transpose(0, 1) != first).sum())


def attention_kernels(cfg: VisionConfig, device: torch.device, dtype: torch.dtype,
                      n_images: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    canvas = plan_canvas(1024, 768, cfg)
    N, H, d = canvas.n_patches, cfg.n_heads, cfg.dim // cfg.n_heads
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n_images * N, H, d, generator=gen).to(device, dtype)
               for _ in range(3))
    flops = n_images * 4.0 * N * N * H * d
    spans = VarlenSpans.from_lengths([N] * n_images, device)
    candidates = {}
    for name in [*available_backends(device), "grouped"]:
        _, fn = select_attention(name, device)
        candidates[f"{name} (packed)"] = lambda fn=fn: fn(q, k, v, spans)
    cudnn_varlen = getattr(torch.ops.aten, "_cudnn_attention_forward", None)
    if cudnn_varlen is not None and device.type == "cuda":
        candidates["cudnn varlen (packed)"] = lambda: cudnn_varlen(
            q, k, v, None, spans.cu_seqlens, spans.cu_seqlens, N, N, False)[0]
    qb, kb, vb = (t.view(n_images, N, H, d).transpose(1, 2) for t in (q, k, v))
    sdpa_backends = {"flash": SDPBackend.FLASH_ATTENTION,
                     "efficient": SDPBackend.EFFICIENT_ATTENTION,
                     "math": SDPBackend.MATH}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        sdpa_backends["cudnn"] = SDPBackend.CUDNN_ATTENTION
    for name, backend in sdpa_backends.items():
        if name == "math" and device.type == "cuda":
            continue

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qb, kb, vb)
        candidates[f"sdpa {name} (B, H, N, d)"] = run

        def per_image(backend=backend):  # B=1 calls: the form a batch-invariant backend takes
            with sdpa_kernel([backend]):
                return torch.cat([F.scaled_dot_product_attention(qb[i:i + 1], kb[i:i + 1],
                                                                 vb[i:i + 1])
                                  for i in range(n_images)])
        if name in ("cudnn", "flash"):
            candidates[f"sdpa {name} per image (1, H, N, d) x B"] = per_image
    reference = None
    for name, fn in candidates.items():
        try:
            out = fn()
            out = out.transpose(1, 2).reshape(n_images * N, H, d) if out.dim() == 4 else out
            if reference is None:
                reference = out.float()
            err = ((out.float() - reference).norm() / reference.norm()).item()
            seconds = best_time(fn, device, repeat=5, warmup=2)
        except Exception as exc:  # a backend this build or device lacks
            print(f"  attention {name:28s} unavailable: {str(exc).splitlines()[0][:100]}")
            continue
        rate = flops / seconds / 1e12
        # Does the first image's output depend on the call's batch? (0: batch-invariant here)
        alone = fn_first_alone(name, candidates, qb, kb, vb, out)
        print(f"  attention {name:28s} {seconds * 1e3:7.2f} ms  {rate:6.1f} TFLOP/s  "
              f"rel diff {err:.1e}" + ("" if alone is None else f", image 0 alone differs "
                                        f"in {alone} values"))
        ROWS.append({"section": "attention", "kernel": name, "seconds": seconds,
                     "tflop_s": rate, "rel_diff": err, "images": n_images, "tokens": N,
                     "image0_alone_differs": alone})


def triton_variants() -> dict:
    """Hand-written Triton RoPE and SwiGLU (one pass each), for comparison with inductor's.
    Empty where Triton is missing (CPU builds)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return {}

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, T, sx0, sx1, HALF: tl.constexpr,
                    HEADS: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        j = tl.arange(0, HEADS * HALF)[None, :]
        h, i = j // HALF, j % HALF
        mask = t < T
        src = x_ptr + t * sx0 + h * sx1 + i
        a = tl.load(src, mask=mask).to(tl.float32)
        b = tl.load(src + HALF, mask=mask).to(tl.float32)
        c = tl.load(cos_ptr + t * HALF + i, mask=mask)
        s = tl.load(sin_ptr + t * HALF + i, mask=mask)
        dst = out_ptr + t * (HEADS * 2 * HALF) + h * (2 * HALF) + i
        tl.store(dst, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_kernel(g_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < I
        g = tl.load(g_ptr + row * 2 * I + col, mask=m).to(tl.float32)
        u = tl.load(g_ptr + row * 2 * I + I + col, mask=m).to(tl.float32)
        tl.store(out_ptr + row * I + col, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty),
                 mask=m)

    def rope(x, cos, sin, block_t=4):
        T, heads, d = x.shape
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rope_kernel[(triton.cdiv(T, block_t),)](x, cos, sin, out, T, x.stride(0), x.stride(1),
                                                 HALF=d // 2, HEADS=heads, BLOCK_T=block_t)
        return out

    def swiglu(gate_up, block=1024):
        T, two_i = gate_up.shape
        out = torch.empty((T, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
        swiglu_kernel[(T, triton.cdiv(two_i // 2, block))](gate_up, out, two_i // 2, BLOCK=block)
        return out

    return {"rope": rope, "swiglu": swiglu}


def elementwise(cfg: VisionConfig, device: torch.device, dtype: torch.dtype,
                n_images: int) -> None:
    """Each elementwise function at a full batch's shape: eager, compiled for any row count
    (``dynamic=True``) and compiled for this shape (``dynamic=False``); GB/s moved."""
    from dsv4enc.tower.fusion import compiled
    from dsv4enc.tower.model import (add_rms_norm, apply_rope, rms_norm, rope_formula, rope_tables,
                               swiglu)

    canvas = plan_canvas(1024, 768, cfg)
    T, D, I = n_images * canvas.n_patches, cfg.dim, cfg.inter_dim
    d = cfg.dim // cfg.n_heads
    gen = torch.Generator().manual_seed(2)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    x, y, qkv, gate_up = rand(T, D), rand(T, D), rand(T, 3 * D), rand(T, 2 * I)
    weight = torch.ones(D, device=device)
    flat = torch.arange(T) % canvas.n_patches
    positions = torch.stack([flat // canvas.n_w, flat % canvas.n_w], dim=1)  # (T, 2) row, col
    cos, sin = (t.to(device) for t in rope_tables(positions, cfg))
    qk = qkv[:, :2 * D].view(T, 2 * cfg.n_heads, d)
    size = x.element_size()
    ops = {  # name: (eager fn, fused formula, args, bytes moved, calls per forward)
        "rms_norm": (rms_norm, rms_norm, (x, weight), 2 * T * D * size, cfg.n_layers + 1),
        "add_rms_norm": (add_rms_norm, add_rms_norm, (x, y, weight), 4 * T * D * size,
                         cfg.n_layers),
        "rope": (apply_rope, rope_formula, (qk, cos, sin), 4 * T * D * size + 2 * cos.nbytes,
                 cfg.n_layers),
        "swiglu": (swiglu, swiglu, (gate_up,), 3 * T * I * size, cfg.n_layers),
    }
    hand = triton_variants() if device.type == "cuda" else {}
    for name, (eager_fn, formula, args, nbytes, calls) in ops.items():
        variants = {"eager": eager_fn, "compiled dynamic": compiled(formula, True),
                    "compiled static": compiled(formula, False)}
        if name in hand:
            variants["triton"] = hand[name]
        want = eager_fn(*args)
        line = []
        for variant, fn in variants.items():
            try:
                seconds = best_time(lambda: fn(*args), device, repeat=10, warmup=2)
                got = fn(*args)
                diff = max(((g.float() - w.float()).abs().max().item() for g, w in zip(
                    got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,))), default=0.0)
            except Exception as exc:  # a compile failure is a finding, not a crash
                print(f"  elementwise {name} {variant}: failed: {str(exc).splitlines()[0][:100]}")
                continue
            line.append(f"{variant} {seconds * 1e6:.1f} us {nbytes / seconds / 1e9:.0f} GB/s "
                        f"(max diff {diff:.2g})")
            ROWS.append({"section": "elementwise", "op": name, "variant": variant,
                         "seconds": seconds, "gb_s": nbytes / seconds / 1e9, "max_diff": diff,
                         "forward_ms": seconds * calls * 1e3, "tokens": T})
        print(f"  elementwise {name:12s} (x{calls}/forward): " + "; ".join(line))


#: Photo sizes of the mixed batch: most on the 1024x768 canvas, as in a photo folder.
MIXED_SIZES = [(1024, 768)] * 6 + [(768, 1024), (1024, 768), (800, 600), (1920, 1080),
                                   (640, 480)]


def attention_mixed(cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Each ``--attention`` choice on one packed batch of mixed sizes (``MIXED_SIZES``)."""
    H, d = cfg.n_heads, cfg.dim // cfg.n_heads
    lengths = [plan_canvas(w, h, cfg).n_patches for w, h in MIXED_SIZES]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), H, d, generator=gen).to(device, dtype)
               for _ in range(3))
    flops = sum(4.0 * n * n * H * d for n in lengths)
    spans = VarlenSpans.from_lengths(lengths, device)
    reference = None
    for name in [*available_backends(device), "grouped"]:
        _, fn = select_attention(name, device)
        out = fn(q, k, v, spans)
        reference = out.float() if reference is None else reference
        err = ((out.float() - reference).norm() / reference.norm()).item()
        seconds = best_time(lambda: fn(q, k, v, spans), device, repeat=5, warmup=2)
        rate = flops / seconds / 1e12
        print(f"  mixed attention {name:10s} {seconds * 1e3:7.2f} ms  {rate:6.1f} TFLOP/s  "
              f"rel diff {err:.1e}  ({len(lengths)} images, {len(set(lengths))} lengths)")
        ROWS.append({"section": "mixed", "kernel": name, "seconds": seconds, "tflop_s": rate,
                     "rel_diff": err, "lengths": lengths})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default="configs/deepseek-v4-flash.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--images", type=int, default=11, help="images per batch (11 x 2961 "
                   "patches fill a 32768-token budget)")
    p.add_argument("--sections", default="elementwise,attention,mixed,breakdown,fused")
    p.add_argument("--attention", default="auto,grouped",
                   help="the attention choices the breakdown and fused sections run")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = VisionConfig.from_file(a.config)
    sections = a.sections.split(",")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}")
    with torch.inference_mode():
        if "elementwise" in sections:
            elementwise(cfg, device, dtype, a.images)
        if "attention" in sections:
            attention_kernels(cfg, device, dtype, a.images)
        if "mixed" in sections:
            attention_mixed(cfg, device, dtype)
        for attention in a.attention.split(","):
            if "breakdown" in sections:
                breakdown(cfg, device, dtype, a.images, False, attention)
            if "fused" in sections:
                breakdown(cfg, device, dtype, a.images, True, attention)
    if a.json:
        Path(a.json).write_text(json.dumps(ROWS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
