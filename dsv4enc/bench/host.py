"""Host capacity without a GPU (``dsv4enc bench --host``): the real encode pipeline with the
tower replaced by ``NullStage``, whose rows (zeros) cost nothing but which does the host's
share of the CUDA engine's work (page-locked copies with CUDA, staging, a fresh copy of each
batch's rows)."""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..tower.checkpoint import Checkpoint
from ..tower.config import VisionConfig
from ..tower.transform import plan_canvas
from ..engine.engine import EngineStats
from ..engine.defaults import DEFAULT_FEATURES, TRANSFORMS
from ..engine.settings import EngineSettings
from ..process import available_cpus
from ..run.options import EncodeOptions, default_workers
from ..engine.packing import PackedBatch
from ..errors import UsageError
from .throughput import check_outputs, failed_note, prepare_images, resolve_images

#: numpy dtypes of the output dtypes (bfloat16 rows are carried as their 16-bit patterns).
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}

#: The fingerprint a null-stage output records (never taken for real weights' rows).
NULL_FINGERPRINT = "null-stage (no model: rows are zeros)"


class NullEngine:
    """The Engine's interface with no model: each image's rows are zeros of the output width
    in ``out_dtype``, as ``settings`` ask (``batch_tokens`` defaults to the CUDA engine's, as
    on a GPU)."""

    graphs_enabled = False
    deterministic = True
    fused = False

    def __init__(self, cfg: VisionConfig, settings: EngineSettings = EngineSettings(),
                 out_dtype: torch.dtype = torch.float16) -> None:
        self.cfg = cfg
        self.device = torch.device("cpu")
        self.settings = settings.for_device("cuda")
        self.features = settings.features
        self.out_dtype = out_dtype
        self.width = cfg.output_width(settings.features)
        self.batch_tokens: int = self.settings.batch_tokens
        self.stats = EngineStats()
        self.last_finite = True
        self._pin = torch.cuda.is_available()
        # The host side of a transfer: a page-locked copy with CUDA, a plain one without.
        self._stage = torch.Tensor.pin_memory if self._pin else torch.Tensor.clone
        self._pending: deque[PackedBatch] = deque()
        self._zeros = np.zeros((0, self.width), _NUMPY_DTYPES[out_dtype])

    @property
    def pending(self) -> int:
        """Batches submitted and not yet collected."""
        return len(self._pending)

    def fit_budgets(self, bin_tokens: Sequence[int], max_budgets: int = 6) -> None:
        """No graphs: nothing to fit."""

    def prepare(self) -> None:
        """No graphs: nothing to capture."""

    def patch_buffer(self, tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """As ``engine/engine.Engine.patch_buffer``: page-locked when CUDA is present."""
        return torch.empty(tokens, width, dtype=dtype, pin_memory=self._pin)

    def transform(self, pixels: np.ndarray) -> torch.Tensor:
        """The host's share of ``engine/engine.Engine.transform``: the pixels' page-locked
        copy (a plain one without CUDA). The patches stand on the meta device: the GPU makes
        them, and the batch is joined there, at no host cost."""
        began = time.perf_counter()
        self._stage(torch.from_numpy(pixels))
        self.stats.h2d_s += time.perf_counter() - began
        canvas = plan_canvas(pixels.shape[1], pixels.shape[0], self.cfg)
        return torch.empty(canvas.n_patches, self.cfg.patch_dim, dtype=torch.bfloat16,
                           device="meta")

    def submit(self, batch: PackedBatch) -> None:
        """Stage the batch's other inputs (the host side of a transfer) and make its rows."""
        began = time.perf_counter()
        # All but the patches, which ``pack`` wrote into the engine's ``patch_buffer``.
        for tensor in (batch.positions, batch.merge_index, batch.merge_mask):
            self._stage(tensor)
        self.stats.h2d_s += time.perf_counter() - began
        if self._zeros.shape[0] < batch.n_rows:  # what the device would write into: made once
            self._zeros = np.zeros((batch.n_rows, self.width), _NUMPY_DTYPES[self.out_dtype])
        self._pending.append(batch)

    def collect(self) -> list[torch.Tensor]:
        """The oldest submitted batch's rows, one tensor per image (a fresh numpy copy, as
        ``pipeline`` makes of the engine's page-locked output)."""
        batch = self._pending.popleft()
        self.stats.batches += 1
        self.stats.real_tokens += batch.n_tokens
        out = torch.from_numpy(self._zeros[:batch.n_rows].copy())
        return batch.split_rows(out if self.out_dtype != torch.bfloat16
                                else out.view(torch.bfloat16))


@dataclass
class NullStage:
    """What ``pipeline.run_encode(stand_in=...)`` takes: a checkpoint that stands for the
    weights (the config's shape, no tensors) and a ``NullEngine`` for the run's options."""

    config: VisionConfig

    @property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.config, {}, NULL_FINGERPRINT, "null stage")

    def engine(self, device: torch.device, opts: EncodeOptions) -> NullEngine:
        return NullEngine(self.config, opts.engine, getattr(torch, opts.out_dtype))


@dataclass
class StageCosts:
    """One thread's CPU milliseconds per image for each host stage, over a sample (CPU time,
    so that other load on the machine does not count)."""

    decode_ms: float = 0.0  # open, read and decode the file's pixels
    transform_ms: float = 0.0  # resize/pad, patchify, normalize to bf16 bits
    pack_ms: float = 0.0  # patches into the staging buffer, positions and merge plans
    stage_ms: float = 0.0  # copy the batch's other inputs for the transfer (pin)
    images: int = 0  # the sample's images that decoded, which the costs are per
    failed: int = 0  # the sample's images that did not (an error row in a run), not timed


def stage_costs(paths: Sequence[Path], cfg: VisionConfig) -> StageCosts:
    """This thread's CPU time, with one torch thread, for decode and transform
    (``throughput.prepare_images``), ``packing.pack`` and staging copies on ``paths``; a
    file that fails to decode (an error row in a run) is counted as failed, not timed."""
    from ..engine.packing import pack

    clock = time.thread_time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # all of the work in this thread, where its clock counts it
    try:
        prep = prepare_images(paths, cfg, DEFAULT_FEATURES)
        buffer = NullEngine(cfg).patch_buffer
        # Once untimed: in a run, a batch's memory is an earlier batch's, already faulted in.
        pack(prep.items, cfg.downsample_ratio, patch_buffer=buffer)
        began = clock()
        batch = pack(prep.items, cfg.downsample_ratio, patch_buffer=buffer)
        packed = clock()
        for tensor in (batch.positions, batch.merge_index, batch.merge_mask):
            tensor.clone()
        staged = clock()
    except UsageError:  # not one image decoded
        return StageCosts(failed=len(paths))
    finally:
        torch.set_num_threads(threads)
    ms = 1e3 / len(prep.items)  # seconds in all -> milliseconds per image
    return StageCosts(prep.decode_s * ms, prep.transform_s * ms, (packed - began) * ms,
                      (staged - packed) * ms, len(prep.items), len(prep.failed))


@dataclass
class HostResult:
    """One host-bench run: throughput, per core, and where the time went."""

    output: str  # "file" or "folder"
    transform: str  # where images were transformed: "host" (Pillow) or "device" (not here)
    images: int  # encoded and failed, as the run's summary counts them
    cores: int
    workers: int
    seconds: float  # the encoding loop (decode wait, pack, stage, rows, hand-off to writers)
    img_s: float  # over the whole call (start-up and a single file's final assembly included)
    img_s_per_core: float  # img_s / cores
    loop_img_s: float  # over the encoding loop alone
    decode_wait_s: float  # the main thread waiting for decoded images
    stage_s: float  # the null engine's staging copies
    write_s: float  # writer threads' seconds, and the final file's assembly
    total_s: float  # the whole call: start-up, headers, plan, loop, final file
    cpu_s: float  # CPU seconds of this process and its decode workers over the call
    out_bytes: int
    costs: StageCosts = field(default_factory=StageCosts)
    failed: int = 0  # of ``images``: error rows (a file that could not be decoded)
    # Images per CPU-second of the images beyond a shorter run's (``run_host_bench(steady=)``):
    # what a long run's images cost each, start-up excluded. None: not measured.
    steady_img_per_cpu_s: float | None = None
    steady_base: int = 0  # images of the shorter run

    @property
    def img_per_cpu_s(self) -> float:
        """Images per CPU-second of the whole call (decode workers included): the host's
        capacity per core, less sensitive than wall time to other load on the machine."""
        return self.images / self.cpu_s if self.cpu_s else 0.0


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and its waited-for children."""
    return sum(os.times()[:4])  # user, system, and the children's user and system


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_host_bench(config_path: str, images: str = "synthetic:1024x768:256",
                   outputs: Sequence[str] = ("file", "folder"), workers: int | None = None,
                   workdir: str | None = None, sample: int = 8, steady: bool = True,
                   transforms: Sequence[str] = ("host",)) -> list[HostResult]:
    """Encode ``images`` (as ``throughput.resolve_images``, made once in ``workdir``) with the
    null stage, once per output kind in ``outputs`` and per ``--transform`` in ``transforms``
    (``device``: the workers decode only, and the host stages the pixels for the GPU).
    ``workers``: decode workers (default: as for a CUDA run here). ``steady``: each run also
    runs on an eighth of the images; the extra images over the extra CPU seconds are
    ``steady_img_per_cpu_s`` (fixed costs cancel). An untimed short run first takes the
    process's one-time costs (imports, pyarrow's start)."""
    from ..run.pipeline import run_encode

    check_outputs(outputs)
    cfg = VisionConfig.from_file(config_path)
    with tempfile.TemporaryDirectory(prefix="dsv4enc-host-") as scratch:
        base = Path(workdir) if workdir else Path(scratch)
        paths = resolve_images(images, base)
        n_workers = default_workers("cuda") if workers is None else workers
        costs = stage_costs(paths[:sample], cfg)
        short = paths[:len(paths) // 8] if steady and len(paths) >= 16 else []

        def timed(kind: str, inputs: Sequence[Path], name: str, transform: str = "host"):
            out = base / (f"{name}-folder" if kind == "folder" else f"{name}.parquet")
            target = f"{out}/" if kind == "folder" else str(out)  # the slash makes a folder
            source = ([str(paths[0].parent)] if len(inputs) == len(paths)
                      else [str(p) for p in inputs])
            opts = EncodeOptions(inputs=source, out=target, config=config_path,
                                 random_init=True, device="cpu", dtype="float32",
                                 out_dtype="float16", workers=n_workers, overwrite=True,
                                 progress=False, transform=transform)
            cpu0, began = _cpu_seconds(), time.perf_counter()
            summary = run_encode(opts, stand_in=NullStage(cfg))
            return summary, time.perf_counter() - began, _cpu_seconds() - cpu0, out

        if short:
            timed(outputs[0] if outputs else "folder", short, "host-warmup")
        results = []
        cores = available_cpus()
        for kind, transform in itertools.product(outputs, transforms):
            short_cpu = timed(kind, short, "host-short", transform)[2] if short else None
            summary, total, cpu, out = timed(kind, paths, "host", transform)
            done = summary.encoded + summary.failed
            loop = summary.encode_s
            steady_rate = (None if short_cpu is None or cpu <= short_cpu
                           else (done - len(short)) / (cpu - short_cpu))
            results.append(HostResult(
                output=kind, transform=transform, images=done, cores=cores, workers=n_workers,
                seconds=loop, img_s=done / total, img_s_per_core=done / total / cores,
                loop_img_s=done / loop if loop else 0.0, decode_wait_s=summary.decode_wait_s,
                stage_s=summary.h2d_s, write_s=summary.write_s, total_s=total, cpu_s=cpu,
                out_bytes=_size(out), costs=costs, steady_img_per_cpu_s=steady_rate,
                steady_base=len(short), failed=summary.failed))
        return results


def print_host_results(results: Sequence[HostResult]) -> None:
    """One paragraph per run (narrow terminals keep every figure), then the stage costs."""
    from rich.console import Console

    console = Console()
    console.print("[bold]host capacity[/bold] (null stage: the model costs nothing)")
    for r in results:
        console.print(
            f"{r.output}, transform on the {r.transform}: {r.images} images"
            f"{failed_note(r.failed, ' (', ': error rows)')} in "
            f"{r.total_s:.2f} s = {r.img_s:.1f} img/s, "
            f"{r.img_s_per_core:.1f} img/s per core ({r.cores} cores, {r.workers} decode "
            f"worker{'s' if r.workers != 1 else ''}); {r.cpu_s:.2f} CPU-s = "
            f"{r.img_per_cpu_s:.1f} images per CPU-second\n"
            f"  encoding loop {r.seconds:.2f} s ({r.loop_img_s:.1f} img/s): waiting for decodes "
            f"{r.decode_wait_s:.2f} s, staging {r.stage_s:.2f} s; writing {r.write_s:.2f} s "
            f"(writer threads, final file); output {r.out_bytes / 1e6:.0f} MB")
        if r.steady_img_per_cpu_s is not None:
            console.print(f"  steady state: {r.steady_img_per_cpu_s:.1f} images per CPU-second "
                          f"(the {r.images}-image run less a {r.steady_base}-image one: "
                          "start-up costs cancel)")
    if results and results[0].costs.images:
        c = results[0].costs
        per_image = c.decode_ms + c.transform_ms + c.pack_ms + c.stage_ms
        console.print(f"one thread's CPU time per image ({c.images} sampled"
                      f"{failed_note(c.failed, '; ', ', not timed')}): decode "
                      f"{c.decode_ms:.1f} ms, transform {c.transform_ms:.1f} ms, pack "
                      f"{c.pack_ms:.2f} ms, stage {c.stage_ms:.2f} ms: "
                      f"{1e3 / max(per_image, 1e-9):.0f} img/s per core before writing")


def host_bench_command(config_path: str, images: str, outputs: Sequence[str],
                       workers: int | None, json_out: str | None = None) -> list[HostResult]:
    """``dsv4enc bench --host``, with the transform on the host and on the device. The process
    is the command's: it makes the settings of the GPU run it stands for."""
    import json

    from ..process import own_process_settings

    own_process_settings(torch.device("cuda"))
    placements = [choice for choice in TRANSFORMS if choice != "auto"]  # host, then device
    results = run_host_bench(config_path, images, outputs, workers, transforms=placements)
    print_host_results(results)
    if json_out:
        with open(json_out, "w") as handle:
            json.dump([{**asdict(r), "img_per_cpu_s": r.img_per_cpu_s} for r in results],
                      handle, indent=1)
    return results
