"""Where a real-dims forward spends its device time, and how fast each attention kernel is.

    PYTHONPATH=. python benchmarks/gpu_profile.py --json prof.json      # on a GPU machine
    PYTHONPATH=. python benchmarks/gpu_profile.py --device cpu --config configs/tiny.json

Two sections, one process:

- ``breakdown``: one packed batch of equal 1024x768-photo grids (47x63 patches) through the
  engine, eager and ``--fused``, under ``torch.profiler``. Device kernel time is split into
  GEMM, attention and the rest (norms, RoPE, adds, activation, copies), and each class's
  achieved TFLOP/s is reported against the FLOPs counted analytically.
- ``attention``: the same q, k, v through every attention kernel this torch offers: the packed
  ``varlen`` kernel the engine uses, and ``scaled_dot_product_attention`` on a (B, H, N, d)
  batch with each SDPA backend forced (flash, cuDNN, memory-efficient). Equal lengths only
  (batched SDPA needs them), so it shows what a kernel could give, not what the packed
  path gets for mixed sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from dsv4enc.attention import VarlenSpans, available_backends, select_attention
from dsv4enc.bench import image_flops
from dsv4enc.checkpoint import build_tower, random_checkpoint
from dsv4enc.config import VisionConfig
from dsv4enc.engine import Engine
from dsv4enc.packing import pack
from dsv4enc.transform import plan_canvas

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int = 5) -> float:
    """Best of ``repeat`` calls after two warm-ups, seconds."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - began)
    return best


def breakdown(cfg: VisionConfig, device: torch.device, dtype: torch.dtype, n_images: int,
              fused: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = build_tower(random_checkpoint(cfg, 0, dtype), device)
    if fused:
        from dsv4enc.fusion import fuse_elementwise

        fuse_elementwise(model)
    batch, canvas = equal_batch(cfg, n_images)
    engine = Engine(model, "aligner", "auto", torch.float16, cuda_graphs=False,
                    batch_tokens=batch.n_tokens, max_images=n_images)
    engine.prepare()
    wall = timed(lambda: engine.encode(batch), device, repeat=3)
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
    tag = "fused" if fused else "eager"
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
    for name in available_backends(device):
        _, fn = select_attention(name, device)
        candidates[f"{name} (packed)"] = lambda fn=fn: fn(q, k, v, spans)
    qb, kb, vb = (t.view(n_images, N, H, d).transpose(1, 2) for t in (q, k, v))
    sdpa_backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
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
    reference = None
    for name, fn in candidates.items():
        try:
            out = fn()
            out = out.transpose(1, 2).reshape(n_images * N, H, d) if out.dim() == 4 else out
            if reference is None:
                reference = out.float()
            err = ((out.float() - reference).norm() / reference.norm()).item()
            seconds = timed(fn, device)
        except Exception as exc:  # a backend this build or device lacks
            print(f"  attention {name:28s} unavailable: {str(exc).splitlines()[0][:100]}")
            continue
        rate = flops / seconds / 1e12
        print(f"  attention {name:28s} {seconds * 1e3:7.2f} ms  {rate:6.1f} TFLOP/s  "
              f"rel diff {err:.1e}")
        ROWS.append({"section": "attention", "kernel": name, "seconds": seconds,
                     "tflop_s": rate, "rel_diff": err, "images": n_images, "tokens": N})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default="configs/deepseek-v4-flash.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--images", type=int, default=11, help="images per batch (11 x 2961 "
                   "patches fill a 32768-token budget)")
    p.add_argument("--sections", default="breakdown,fused,attention")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = VisionConfig.from_file(a.config)
    sections = a.sections.split(",")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    with torch.inference_mode():
        if "attention" in sections:
            attention_kernels(cfg, device, dtype, a.images)
        if "breakdown" in sections:
            breakdown(cfg, device, dtype, a.images, fused=False)
        if "fused" in sections:
            breakdown(cfg, device, dtype, a.images, fused=True)
    if a.json:
        Path(a.json).write_text(json.dumps(ROWS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
