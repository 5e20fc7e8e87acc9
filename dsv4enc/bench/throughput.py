"""Throughput benchmark, run by ``dsv4enc bench``: one config and one image mix, in one process.

- ``model``: the engine alone over pre-transformed, bin-packed batches, per budget and graph
  setting: img/s, tokens/s, FLOP/s (analytic, real tokens only) against ``matmul_ceiling``,
  padding, time split;
- ``naive``: one image at a time with 3-D attention, the baseline every ratio is against;
- ``e2e`` and ``cli`` (optional): the encode pipeline in this process, and ``dsv4enc encode``
  in a fresh process (the interpreter's start and torch's import included)."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from ..errors import DsvError
from ..tower.attention import naive_sdpa_attention
from ..engine.batching import BatchLoop
from ..engine.engine import Engine, EngineStats
from ..engine.factory import build_model
from ..engine.defaults import DEFAULT_FEATURES, DEFAULT_MAX_IMAGES, default_batch_tokens
from ..tower.checkpoint import random_checkpoint, random_state_dict, save_checkpoint
from ..tower.config import VisionConfig
from ..engine.device import resolve_device, resolve_dtype
from ..tower.model import VisionTower
from ..engine.packing import PackedBatch, pack
from ..engine.bins import pack_bins
from ..run.plan import image_flops
from ..process import keep_freed_memory_mapped, own_process_settings
from ..tower.transform import bf16_bits_to_tensor, image_to_patch_bits, image_to_patches

T = TypeVar("T")

#: The CPU mix: 24 photo-like sizes from 300x300 to 2000x1500, mixed orientations.
MIX_SIZES = [(300, 300), (400, 300), (350, 500), (500, 375), (640, 480), (480, 640),
             (600, 900), (900, 600), (800, 600), (800, 800), (1000, 1000), (1024, 768),
             (768, 1024), (1280, 720), (720, 1280), (1280, 960), (1400, 1050), (1200, 1600),
             (1600, 1200), (1920, 1080), (1080, 1920), (1500, 2000), (2000, 1500), (1800, 1200)]


def photo_like(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """(height, width, 3) uint8: smooth colours and soft blobs (made at 1/8 size, upsampled)
    plus sensor-like noise, so that JPEG sizes and decode costs are those of photos."""
    from PIL import Image

    lw, lh = max(2, width // 8), max(2, height // 8)
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    low = np.asarray(Image.fromarray(coarse).resize((lw, lh), Image.BICUBIC), np.float32)
    yy, xx = np.mgrid[0:lh, 0:lw].astype(np.float32)
    for _ in range(4):
        cx, cy = rng.uniform(0, lw), rng.uniform(0, lh)
        radius = rng.uniform(0.05, 0.3) * min(lw, lh)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * radius ** 2))
        low += blob[..., None] * rng.uniform(-80, 80, 3).astype(np.float32)
    low = np.clip(low, 0, 255).astype(np.uint8)
    base = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), np.int16)
    noise = rng.integers(-8, 9, base.shape, dtype=np.int16)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def synthetic_images(folder: Path, spec: str, seed: int = 0) -> list[Path]:
    """Write JPEGs for ``spec``: "mix" (MIX_SIZES), "mix:N" (the mix repeated to N images),
    or "WxH:N" (N images of one size). Returns the paths in order."""
    from PIL import Image

    kind, _, count = spec.partition(":")
    try:  # a spec not of this form is the user's one line, not Python's int() message
        if kind == "mix":
            n = int(count) if count else len(MIX_SIZES)
            sizes = [MIX_SIZES[i % len(MIX_SIZES)] for i in range(n)]
        else:
            w, h = (int(v) for v in kind.lower().split("x"))
            sizes = [(w, h)] * (int(count) if count else 16)
    except ValueError:
        raise ValueError(f"--images synthetic:{spec}: give synthetic:mix[:N] or "
                         "synthetic:WxH[:N]") from None
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = [folder / f"img{i:04d}_{w}x{h}.jpg" for i, (w, h) in enumerate(sizes)]
    for path, (w, h) in zip(paths, sizes):
        if not path.exists():
            Image.fromarray(photo_like(w, h, rng)).save(path, quality=90)
    return paths


def resolve_images(images: str, workdir: Path, seed: int = 0) -> list[Path]:
    """``images``: a folder of images, or "synthetic:..." (see ``synthetic_images``)."""
    if images.startswith("synthetic:"):
        spec = images.removeprefix("synthetic:")
        # One folder per spec: the end-to-end run encodes the whole folder.
        return synthetic_images(workdir / f"images-{spec.replace(':', '-')}", spec, seed)
    folder = Path(images)
    exts = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in exts)
    if not paths:
        raise ValueError(f"no images found in {folder}")
    return paths


def check_outputs(outputs: Sequence[str]) -> None:
    """A ValueError naming the ``outputs`` (of ``--outputs``) that are neither file nor folder."""
    if unknown := set(outputs) - {"file", "folder"}:
        raise ValueError(f"outputs must be file or folder, not {', '.join(sorted(unknown))}")


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU or without a device."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(fn: Callable[[], T], repeat: int,
            device: torch.device | None = None) -> tuple[float, T | None]:
    """Seconds and result of the fastest of ``repeat`` calls of ``fn``, ``device`` synced."""
    best, result = float("inf"), None
    for _ in range(repeat):
        sync(device)
        began = time.perf_counter()
        out = fn()
        sync(device)
        wall = time.perf_counter() - began
        if wall < best:
            best, result = wall, out
    return best, result


def summed_minima(fn: Callable[[Any], T], items: Sequence[Any], repeat: int,
                  device: torch.device) -> tuple[float, list[T]]:
    """Each item's best time of ``fn(item)`` over ``repeat`` rounds, summed, and the last
    round's results. On a shared machine a busy core inflates whole passes at random;
    per-item minima estimate the machine's own speed much more stably."""
    best = [float("inf")] * len(items)
    results: list[T] = []
    for _ in range(max(1, repeat)):
        results = []
        for i, item in enumerate(items):
            seconds, out = fastest(functools.partial(fn, item), 1, device)
            best[i] = min(best[i], seconds)
            results.append(out)
    return sum(best), results


def best_time(fn: Callable[[], object], device: torch.device, repeat: int,
              warmup: int = 1) -> float:
    """Best of ``repeat`` timed calls after ``warmup`` untimed ones, seconds."""
    for _ in range(warmup):
        fn()
    return fastest(fn, repeat, device)[0]


def matmul_ceiling(cfg: VisionConfig, tokens: int, dtype: torch.dtype,
                   device: torch.device, repeat: int = 5) -> dict[str, float]:
    """FLOP/s of the model's GEMM shapes at ``tokens`` rows (best shape = the ceiling), and of
    a large square product (the device peak)."""
    D, I, hid = cfg.dim, cfg.inter_dim, cfg.hidden_size
    r2 = cfg.downsample_ratio ** 2
    shapes = {"qkv": (tokens, D, 3 * D), "mlp_in": (tokens, D, 2 * I),
              "mlp_out": (tokens, I, D), "aligner": (max(tokens // r2, 64), D * r2, hid)}
    rates = {}
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        for name, (m, k, n) in shapes.items():
            a = torch.randn(m, k, generator=gen).to(device, dtype)
            b = torch.randn(n, k, generator=gen).to(device, dtype)
            rates[name] = 2.0 * m * k * n / best_time(lambda: a @ b.T, device, repeat)
        side = 8192 if device.type == "cuda" else 2048
        a = torch.randn(side, side, generator=gen).to(device, dtype)
        rates["square"] = 2.0 * side ** 3 / best_time(lambda: a @ a, device, repeat)
    rates["ceiling"] = max(rates[k] for k in shapes)
    return rates


@dataclass
class Prepared:
    """Images transformed once, outside every timed region; those that failed, apart."""

    #: (patches, n_h, n_w) of each image that decoded
    items: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)  # the images of ``items``, in order
    failed: dict[str, str] = field(default_factory=dict)  # path -> its error row's words
    flops: float = 0.0
    decode_s: float = 0.0  # this thread's CPU seconds opening and decoding ``items``
    transform_s: float = 0.0  # and transforming them

    @property
    def tokens(self) -> int:
        return sum(h * w for _, h, w in self.items)


def prepare_images(paths: Sequence[Path], cfg: VisionConfig, features: str) -> Prepared:
    """Decode (``decode.open_checked``) and transform ``paths`` as ``encode`` does, timed on
    this thread's clock: a file that fails is counted with its error (an error row in a run),
    not timed. A UsageError when none can be decoded."""
    from ..errors import UsageError
    from ..images.decode import open_checked, read_failure
    from ..images.formats import DEFAULT_MAX_PIXELS

    prep, clock = Prepared(), time.thread_time
    for path in paths:
        began = clock()
        try:
            with open_checked(path, DEFAULT_MAX_PIXELS) as image:
                image.load()
                loaded = clock()
                bits, canvas = image_to_patch_bits(image, cfg)
        except Exception as exc:  # noqa: BLE001 - as in a run: the file's error row, not a crash
            prep.failed[str(path)] = read_failure(exc, path)[0]
            continue
        prep.decode_s += loaded - began
        prep.transform_s += clock() - loaded
        prep.items.append((bf16_bits_to_tensor(bits), canvas.n_h, canvas.n_w))
        prep.paths.append(path)
    if not prep.items:
        first, error = next(iter(prep.failed.items()))
        raise UsageError(f"no image could be decoded ({len(paths)} tried; {first}: {error})")
    prep.flops = sum(image_flops(cfg, h, w, features) for _, h, w in prep.items)
    return prep


def encode_all(loop: BatchLoop, batches: Sequence[PackedBatch]) -> None:
    """Every batch through ``loop``, one in flight ahead (transfers overlap compute)."""
    for batch in batches:
        loop.submit_packed(range(len(batch.lengths)), batch)
        loop.collect_ready()
    loop.drain()


def bench_model(model: VisionTower, prep: Prepared, features: str, batch_tokens: int,
                cuda_graphs: bool | None, attention: str, max_images: int, repeat: int,
                out_dtype: torch.dtype, fused: bool = False) -> dict:
    """Engine-only throughput over the prepared images: on CUDA the best of ``repeat`` whole
    passes (one batch in flight, so transfers overlap compute), else ``summed_minima``."""
    cfg, device = model.cfg, model.device
    bins = pack_bins([h * w for _, h, w in prep.items], batch_tokens, max_images)
    batches = [pack([prep.items[i] for i in b], cfg.downsample_ratio, features) for b in bins]
    engine = Engine(model, features=features, attention=attention, out_dtype=out_dtype,
                    cuda_graphs=cuda_graphs, batch_tokens=batch_tokens, max_images=max_images)
    engine.fit_budgets([b.n_tokens for b in batches])  # as the encode pipeline does
    engine.prepare()
    loop = BatchLoop(engine, copy=False)  # the loop the encode pipeline and the API run
    encode_all(loop, batches[:1])  # warm-up (kernels, allocator)
    engine.stats = EngineStats()
    if device.type == "cuda":
        def one_pass() -> EngineStats:
            engine.stats = EngineStats()
            encode_all(loop, batches)
            return engine.stats

        best, s = fastest(one_pass, max(1, repeat), device)
        model_s = s.model_s
    else:
        best = model_s = summed_minima(lambda batch: encode_all(loop, [batch]), batches,
                                       repeat, device)[0]
        s = engine.stats
    row = {
        "mode": "model", "graphs": engine.graphs_enabled, "attention": engine.attention_name,
        "fused": fused, "batch_tokens": batch_tokens, "images": len(prep.items),
        "batches": len(batches), "seconds": best, "img_s": len(prep.items) / best,
        "tokens_s": prep.tokens / best,
        "flop_s": prep.flops / best, "padding": s.padded_tokens / max(1, s.real_tokens),
        "h2d_s": s.h2d_s, "model_s": model_s, "d2h_s": s.d2h_s,
        "device_idle": max(0.0, 1.0 - model_s / best) if device.type == "cuda" else None,
        "capture_s": engine.runner.capture_s if engine.runner is not None else 0.0,
        "graph_batches": s.graph_batches, "variant_batches": s.variant_batches,
    }
    engine = loop = None  # the loop holds the engine too: both go before the cache is emptied
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_naive(model: VisionTower, paths: Sequence[Path], features: str,
                out_dtype: torch.dtype, repeat: int = 1) -> dict:
    """One image at a time (decode, transform, forward with 3-D attention): ``summed_minima``."""
    from PIL import Image

    cfg, device = model.cfg, model.device

    def one(path: Path) -> tuple[int, int]:
        with Image.open(path) as image:
            image.load()
            patches, canvas = image_to_patches(image, cfg)
        with torch.inference_mode():
            out = model.forward_image(patches.to(device), canvas.n_h, canvas.n_w, features)
            out.to(out_dtype).cpu()
        return canvas.n_h, canvas.n_w

    saved = model.attend
    model.attend = naive_sdpa_attention
    try:
        one(paths[0])  # warm-up
        wall, grids = summed_minima(one, paths, repeat, device)
    finally:
        model.attend = saved
    tokens = sum(h * w for h, w in grids)
    flops = sum(image_flops(cfg, h, w, features) for h, w in grids)
    return {"mode": "naive", "graphs": False, "attention": "sdpa-3d", "images": len(paths),
            "seconds": wall, "img_s": len(paths) / wall, "tokens_s": tokens / wall,
            "flop_s": flops / wall}


def bench_e2e(config_path: str, paths: Sequence[Path], device: str, dtype: str,
              batch_tokens: int, cuda_graphs: bool | None, attention: str, workdir: Path,
              max_images: int, workers: int | None, repeat: int = 1, output: str = "file",
              fused: bool = False, features: str = DEFAULT_FEATURES) -> dict:
    """The full ``encode`` pipeline (start-up, decode workers, engine, Parquet) on the folder
    holding ``paths``, to one file or a folder of parts (``output``); best of ``repeat`` runs."""
    from ..run.pipeline import EncodeOptions, run_encode  # only this mode needs the pipeline

    out = workdir / ("bench.parquet" if output == "file" else "bench_parts/")
    opts = EncodeOptions(inputs=[str(paths[0].parent)], out=str(out),
                         config=config_path, random_init=True, device=device, dtype=dtype,
                         features=features, out_dtype="float16", batch_tokens=batch_tokens, max_images=max_images,
                         attention=attention, cuda_graphs=cuda_graphs, overwrite=True,
                         progress=False, workers=workers, fused=fused)
    best, summary = fastest(lambda: run_encode(opts), max(1, repeat))
    n = summary.encoded
    return {"mode": "e2e", "output": output, "graphs": cuda_graphs, "attention": attention,
            "fused": fused, "batch_tokens": batch_tokens, "images": n,
            "failed": summary.failed, "seconds": best,
            "img_s": n / best, "tokens_s": summary.tokens / best, "padding": summary.padding_waste,
            "encode_s": summary.encode_s, "steady_img_s": n / max(summary.encode_s, 1e-9),
            "device_idle": max(0.0, 1 - summary.model_s / max(summary.encode_s, 1e-9)),
            "h2d_s": summary.h2d_s, "model_s": summary.model_s,
            "decode_wait_s": summary.decode_wait_s, "write_s": summary.write_s}


def bench_cli(cfg: VisionConfig, paths: Sequence[Path], device: str, dtype: str,
              batch_tokens: int, workdir: Path, workers: int | None,
              seed: int = 0, repeat: int = 1, weights: Path | None = None,
              engine_flags: Sequence[str] = ()) -> dict:
    """``dsv4enc encode`` as a user runs it, best of ``repeat``: a fresh process each time, its
    start, imports and loading ``weights`` (or random ones saved to ``workdir``) timed too.
    ``engine_flags``: the other rows' engine options, as command-line flags. Its rate counts
    the images the run encoded (its ``--summary-json``), not those that failed."""
    import subprocess
    import sys

    ckpt = weights if weights is not None else workdir / "bench-checkpoint"
    saved = ckpt / "config.json"  # an earlier bench's, in --workdir: of this config only
    if weights is None and not (saved.is_file() and VisionConfig.from_file(saved) == cfg):
        save_checkpoint(ckpt, cfg, random_state_dict(cfg, seed))
    command = [sys.executable, "-m", "dsv4enc", "encode", str(paths[0].parent),
               "--out", str(workdir / "bench-cli.parquet"), "--weights", str(ckpt),
               "--device", device, "--dtype", dtype, "--batch-tokens", str(batch_tokens),
               "--overwrite", "--quiet", "--summary-json", str(workdir / "bench-cli.json"),
               *engine_flags]
    if workers is not None:
        command += ["--workers", str(workers)]
    package_root = str(Path(__file__).resolve().parents[2])  # runs from a working tree too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}

    def once() -> None:
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [""])[-1]  # its own one line
            raise DsvError(f"dsv4enc encode failed ({done.returncode}): {last[-2000:]}")

    best = fastest(once, max(1, repeat))[0]
    images = json.loads((workdir / "bench-cli.json").read_text())["images"]
    return {"mode": "cli", "batch_tokens": batch_tokens, "images": images["encoded"],
            "failed": images["failed"], "seconds": best, "img_s": images["encoded"] / best}


def _engine_flags(features: str, attention: str, cuda_graphs: bool | None,
                  fused: bool) -> list[str]:
    """The engine options the in-process rows ran with, as ``encode``'s flags."""
    flags = ["--features", features, "--attention", attention,
             "--fused" if fused else "--no-fused"]
    if cuda_graphs is not None:
        flags.append("--cuda-graphs" if cuda_graphs else "--no-cuda-graphs")
    return flags


def run_bench(config_path: str, device: str = "auto", dtype: str = "auto",
              images: str = "synthetic:mix", batch_tokens: Sequence[int] | int | None = None,
              cuda_graphs: Sequence[bool | None] = (None,), attention: str = "auto",
              features: str = DEFAULT_FEATURES, max_images: int = DEFAULT_MAX_IMAGES,
              repeat: int = 2, naive_images: int | None = None, e2e: bool = False,
              workers: int | None = None, seed: int = 0, workdir: str | None = None,
              cli: bool = False, fused: Sequence[bool] = (False,),
              e2e_outputs: Sequence[str] = ("file",)) -> list[dict]:
    """Run the benchmark; one dict per measurement (see module doc), each with ``vs_naive``
    (img/s over the naive loop's) and ``ceiling_frac`` (FLOP/s over the matmul ceiling).
    ``images``: as ``resolve_images``. ``batch_tokens``: one budget or several (default: the
    device's). ``cuda_graphs``, ``fused``: the settings to compare (None = engine default).
    ``naive_images``: the naive baseline on the first N images only (its rate is per image,
    so the ratio stays fair for a repeating mix). ``e2e``, ``cli``: also time those modes."""
    check_outputs(e2e_outputs)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cfg = VisionConfig.from_file(config_path)
    budgets = ([batch_tokens] if isinstance(batch_tokens, int) else list(batch_tokens or [])) \
        or [default_batch_tokens(dev.type)]
    out_dtype = torch.float16
    state = random_checkpoint(cfg, seed, dt)
    model = build_model(state, dev, fused=False)
    fused_model = build_model(state, dev, fused=True) if any(fused) else None
    del state
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        base = (Path(workdir) if workdir
                else Path(stack.enter_context(tempfile.TemporaryDirectory())))
        paths = resolve_images(images, base, seed)
        prep = prepare_images(paths, cfg, features)
        ceiling = matmul_ceiling(cfg, max(budgets), dt, dev)
        # The naive loop first, with the default allocator, as a plain first port would run:
        # the command line's CPU heap tuning (process.py) is part of what engine rows measure.
        timed = prep.paths[:naive_images] if naive_images else prep.paths
        naive = bench_naive(model, timed, features, out_dtype, repeat)
        if dev.type == "cpu":
            keep_freed_memory_mapped()  # as the command line does before its engine runs
        for bt, graphs, fuse in itertools.product(budgets, cuda_graphs, fused):
            if not graphs or dev.type == "cuda":
                rows.append(bench_model(fused_model if fuse else model, prep, features, bt,
                                        graphs, attention, max_images, repeat, out_dtype, fuse))
        rows.append(naive)
        # Once more at the end, keeping the best: a ceiling measured while the machine was
        # busy would flatter every fraction.
        again = matmul_ceiling(cfg, max(budgets), dt, dev)
        ceiling = {k: max(v, again[k]) for k, v in ceiling.items()}
        for row in rows:
            row["ceiling_frac"] = row["flop_s"] / ceiling["ceiling"]
            row["peak_frac"] = row["flop_s"] / ceiling["square"]
        if e2e:
            own_process_settings(dev)  # as the command line makes them before a run
            del fused_model, model  # the pipeline builds its own tower
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            for fuse, output in itertools.product(fused, e2e_outputs):
                rows.append(bench_e2e(config_path, paths, device, dtype, budgets[-1],
                                      cuda_graphs[0], attention, base, max_images, workers,
                                      repeat, output, fuse, features))
        if cli:
            rows.append(bench_cli(cfg, paths, dev.type, str(dt).removeprefix("torch."),
                                  budgets[-1], base, workers, seed, repeat,
                                  engine_flags=_engine_flags(features, attention, cuda_graphs[0],
                                                             fused[0])))
    for row in rows:
        row["vs_naive"] = row["img_s"] / naive["img_s"]
    threads = torch.get_num_threads()
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"{platform.processor() or platform.machine()} ({threads} threads)")
    meta = {"mode": "meta", "device": name, "device_type": dev.type,
            "dtype": str(dt).removeprefix("torch."), "config": Path(config_path).name,
            "images": len(prep.items), "failed": len(prep.failed), "tokens": prep.tokens,
            "gflop_per_image": prep.flops / len(prep.items) / 1e9,
            "threads": threads, "torch": torch.__version__,
            **{f"matmul_{k}": v for k, v in ceiling.items()}}
    return [meta] + rows


def print_results(rows: Sequence[dict]) -> None:
    """Print ``run_bench`` results as a rich table (FLOP/s in TFLOP/s on CUDA, else GFLOP/s)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table to 80 columns
        console = Console(width=170)
    meta = next((r for r in rows if r.get("mode") == "meta"), {})
    unit, scale = ("TFLOP/s", 1e12) if meta.get("device_type") == "cuda" else ("GFLOP/s", 1e9)
    title = (f"{meta.get('config', '?')} on {meta.get('device', '?')}, {meta.get('dtype', '?')}: "
             f"{meta.get('images', '?')} images"
             f"{failed_note(meta.get('failed'), ' (', ', not timed)')}, "
             f"{meta.get('tokens', '?')} patches, "
             f"{meta.get('gflop_per_image', 0):.1f} GFLOP/image; matmul ceiling "
             f"{meta.get('matmul_ceiling', 0) / scale:.1f} {unit} "
             f"(square {meta.get('matmul_square', 0) / scale:.1f})")
    numbers = (("budget", "batch_tokens", "d"), ("img/s", "img_s", ".2f"),
               ("tokens/s", "tokens_s", ",.0f"), (unit, "flop_s", ".1f"),
               ("ceiling", "ceiling_frac", ".0%"), ("peak", "peak_frac", ".0%"),
               ("padding", "padding", ".1%"), ("h2d s", "h2d_s", ".3f"),
               ("model s", "model_s", ".3f"), ("d2h s", "d2h_s", ".3f"),
               ("idle", "device_idle", ".0%"), ("vs naive", "vs_naive", ".2f"))
    table = Table(title=title)
    for name in ("mode", "graphs", "fused", "attention", *(name for name, _, _ in numbers)):
        table.add_column(name, justify="left" if name in ("mode", "attention") else "right")
    for r in rows:
        if r.get("mode") == "meta":
            continue
        shown = {**r, "flop_s": r["flop_s"] / scale if r.get("flop_s") else None}
        table.add_row(r["mode"] + (f" ({r['output']})" if r.get("output") else ""),
                      *(str(r.get(key, "-")) for key in ("graphs", "fused", "attention")),
                      *("-" if shown.get(key) is None else format(shown[key], spec)
                        for _, key, spec in numbers))
    console.print(table)


def failed_note(failed: int | None, before: str, after: str) -> str:
    """``{before}2 failed{after}`` where images failed to decode, else nothing."""
    return f"{before}{failed} failed{after}" if failed else ""


def parse_on_off(text: str, auto: bool = False, option: str = "") -> list[bool | None]:
    """"off,on" -> [False, True]; with ``auto``, "auto" -> None. A bad word is a ValueError
    naming ``option`` and the words it takes, the user's one line."""
    names = {**({"auto": None} if auto else {}), "on": True, "off": False}
    bad = [t for t in text.split(",") if t not in names]
    if bad:
        raise ValueError(f"{option} takes {', '.join(names)} (comma-separated), not {bad[0]!r}")
    return [names[t] for t in text.split(",")]
