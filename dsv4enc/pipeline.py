"""The encode run: inputs -> headers -> plan -> decode workers -> device -> Parquet parts.

Offline, every image's patch grid is known from its header before any pixel is decoded, so
the whole run is planned up front: items are cut into *parts* (consecutive input ranges, the
unit of commit and resume), each part's images are packed into nearly full batches, and
decode workers stream exactly those images, in that order, a bounded distance ahead of the
device. Parts are written by a background thread. Under torchrun, each part's images are
shared among ranks by the greedy rule of SPEC §7 (or the tower is split, SPEC §8).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from . import __version__
from .checkpoint import COMPUTE_DTYPES, Checkpoint, build_tower, load_checkpoint, random_checkpoint
from .config import VisionConfig
from .decode import DEFAULT_MAX_PIXELS, DecodePool, Decoded, Probe, patches_tensor, probe_image
from .engine import Engine
from .errors import DsvError, OutputError, UsageError
from .inputs import InputItem, discover
from .packing import output_grid, pack, pack_bins
from .progress import RunProgress
from .transform import plan_canvas
from .writer import (PartStore, Row, StreamingAssembler, output_schema, remove_tree,
                     rows_per_group, rows_to_table)

log = logging.getLogger("dsv4enc")

PART_BYTES = 256 << 20  # upper bound of one part's embeddings in memory
HEADER_CHUNK = 4096  # header probes submitted to the thread pool at a time
# Parts of small models are capped in images: writing a part's Parquet takes transient memory
# several times its embeddings (float16 most), and up to four parts are in flight.
MAX_PART_IMAGES = 1024


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run after committing finished parts."""

    def __init__(self, signum: int, resume_hint: str) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {resume_hint}")
        self.exit_code = 128 + signum


@dataclass
class EncodeOptions:
    """Everything ``dsv4enc encode`` can be asked to do (the CLI maps its flags onto this)."""

    inputs: list[str]
    out: str
    files_from: str | None = None
    image_column: str | None = None
    key_column: str | None = None
    weights: str | None = None
    config: str | None = None
    random_init: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    out_dtype: str = "float16"
    features: str = "aligner"
    pool: str = "none"
    batch_tokens: int | None = None
    max_images: int = 64
    workers: int | None = None
    overwrite: bool = False
    resume: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS
    decode_timeout: float = 120.0
    attention: str = "auto"
    cuda_graphs: bool | None = None
    shard_output: bool = False
    tp_mode: str = "data"
    balance: str = "patches"
    timeout: float = 300.0
    part_images: int | None = None
    progress: bool = True


@dataclass
class RunSummary:
    """What a run did, for the summary line and for callers."""

    out: str
    encoded: int = 0
    failed: int = 0
    skipped: int = 0
    reused: int = 0
    seconds: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0
    merge_pad_tokens: int = 0
    decode_wait_s: float = 0.0
    h2d_s: float = 0.0
    model_s: float = 0.0
    write_s: float = 0.0
    encode_s: float = 0.0  # the encoding loop alone: no start-up, header reading or capture
    errors: dict[str, int] = field(default_factory=dict)
    rank_loads: list[float] = field(default_factory=list)

    @property
    def padding_waste(self) -> float:
        """Padded tokens (graph budgets and merge padding) per real token."""
        return (self.padded_tokens + self.merge_pad_tokens) / max(self.tokens, 1)


@dataclass
class Planned:
    """One input after its header was read: its grid, or why it cannot be encoded."""

    item: InputItem
    width: int | None = None
    height: int | None = None
    n_h: int = 0
    n_w: int = 0
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.n_h * self.n_w


# ----------------------------------------------------------------------------- set-up

def resolve_device(name: str, dist=None) -> torch.device:
    """``auto`` is CUDA when available (this rank's LOCAL_RANK device under torchrun)."""
    if dist is not None:
        return dist.device
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {name} asked for, but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {name!r} (use auto, cpu, cuda or cuda:N)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in COMPUTE_DTYPES:
        raise UsageError(f"unknown dtype {name!r} (use auto, float32, bfloat16 or float16)")
    return COMPUTE_DTYPES[name]


def validate(opts: EncodeOptions) -> None:
    """Reject options that make no sense, alone or together."""
    if not opts.inputs and not opts.files_from:
        raise UsageError("no inputs: give folders or image files, or --files-from LIST")
    if opts.resume and opts.overwrite:
        raise UsageError("--resume and --overwrite contradict each other; choose one")
    if opts.random_init and opts.weights:
        raise UsageError("--random-init and --weights contradict each other; choose one")
    if opts.random_init and not opts.config:
        raise UsageError("--random-init needs --config FILE for the tower's shape")
    if not opts.random_init and not opts.weights:
        raise UsageError("no weights: pass --weights DIR, set DSV4ENC_WEIGHTS, "
                         "or use --config FILE --random-init")
    if opts.config and not opts.random_init:
        raise UsageError("--config only applies with --random-init (a checkpoint has its own "
                         "config.json)")
    choices = {"out_dtype": ("float16", "float32"), "features": ("aligner", "vit"),
               "pool": ("none", "mean"), "tp_mode": ("data", "weights"),
               "balance": ("patches", "flops")}
    for name, allowed in choices.items():
        if getattr(opts, name) not in allowed:
            raise UsageError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}")
    for name in ("batch_tokens", "max_images", "max_pixels", "part_images"):
        value = getattr(opts, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if opts.workers is not None and opts.workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {opts.workers}")
    if opts.decode_timeout <= 0 or opts.timeout <= 0:
        raise UsageError("timeouts must be positive")
    if opts.shard_output and opts.tp_mode == "weights":
        raise UsageError("--shard-output applies to --tp-mode data only")


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(device: torch.device) -> int:
    cpus = available_cpus()
    if device.type == "cuda":
        return max(1, min(cpus - 1, 16))
    # On the CPU the model wants the cores; one decoder keeps it fed on small machines.
    return max(1, cpus // 4)


def load_model(opts: EncodeOptions, dtype: torch.dtype) -> Checkpoint:
    if opts.random_init:
        return random_checkpoint(VisionConfig.from_file(opts.config), opts.seed, dtype)
    from .hub import resolve_weights

    return load_checkpoint(resolve_weights(opts.weights), dtype)


# ----------------------------------------------------------------------------- planning

def read_headers(items: Sequence[InputItem], cfg: VisionConfig, max_pixels: int,
                 dist=None, should_stop: Callable[[], bool] | None = None) -> list[Planned]:
    """Probe every header (threads; ranks split the work and share results) and plan grids.

    When ``should_stop()`` turns true (a signal), the headers not read yet are left as error
    rows and the caller is expected to stop: reading a million headers takes minutes."""
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    mine = list(range(rank, len(items), world))
    probes: list[Probe] = []
    stopped = False
    with ThreadPoolExecutor(max_workers=16) as pool:
        # In chunks: a future per input, all submitted at once, costs ~1.7 KB each until
        # the last header is read (gigabytes for millions of images).
        for begin in range(0, len(mine), HEADER_CHUNK):
            chunk = mine[begin:begin + HEADER_CHUNK]
            for probe in pool.map(lambda i: probe_image(items[i], max_pixels), chunk):
                probes.append(probe)
                if should_stop is not None and should_stop():
                    stopped = True
                    break
            if stopped:
                pool.shutdown(wait=True, cancel_futures=True)
                break
    probes += [Probe(error="interrupted before its header was read")] * (len(mine) - len(probes))
    from .sources import clear_cache

    clear_cache()  # table row groups read for the probes: the workers read their own
    if dist is not None:
        shared = dist.all_gather_object([(i, asdict(p)) for i, p in zip(mine, probes)])
        by_index = {i: Probe(**p) for part in shared for i, p in part}
    else:
        by_index = dict(zip(mine, probes))
    planned = []
    for index, item in enumerate(items):
        probe = by_index[index]
        entry = Planned(item, probe.width, probe.height, error=probe.error)
        if probe.error is None:
            try:
                canvas = plan_canvas(probe.width, probe.height, cfg)
                entry.n_h, entry.n_w = canvas.n_h, canvas.n_w
            except ValueError as exc:
                entry.error = f"ValueError: {exc}"
        planned.append(entry)
    return planned


def images_per_part(cfg: VisionConfig, opts: EncodeOptions) -> int:
    """Images per part so a part's embeddings stay under PART_BYTES even at the largest grid.

    Depends on the config and output settings only, so that a resumed run cuts the same parts.
    """
    if opts.part_images:
        return opts.part_images
    max_patches = (cfg.max_n_token * cfg.downsample_ratio ** 2 if opts.features == "vit"
                   else cfg.max_n_token)
    row_bytes = cfg.output_width(opts.features) * (2 if opts.out_dtype == "float16" else 4)
    per_image = row_bytes * (1 if opts.pool == "mean" else max_patches)
    return int(min(MAX_PART_IMAGES, max(16, PART_BYTES // per_image)))


def keys_digest(planned: Sequence[Planned]) -> str:
    digest = hashlib.blake2b(digest_size=12)
    for entry in planned:
        digest.update(entry.item.key.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the run

class _Stop:
    """Records SIGINT/SIGTERM so the loop can stop between batches."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signum = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class _PartWriter:
    """Commits parts on background threads so the device never waits for Parquet.

    Encoding a part's nested float lists is CPU work that releases the GIL, so several
    threads commit parts side by side on machines with cores to spare."""

    def __init__(self, store: PartStore, schema, threads: int = 1,
                 assembler: StreamingAssembler | None = None) -> None:
        self.store = store
        self.schema = schema
        self.assembler = assembler
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=threads)
        self._threads = [threading.Thread(target=self._run, name=f"dsv4enc-writer-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue
            name, rows, start, end, digest = job
            began = time.perf_counter()
            try:
                table = rows_to_table(rows, self.schema)
                group_rows = rows_per_group(self.schema, rows)
                del job, rows  # the table holds a copy: free the rows before the write
                self.store.commit(name, table, group_rows, start, end, digest)
                if self.assembler is not None:
                    self.assembler.notify()
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc
            with self._lock:
                self.seconds += time.perf_counter() - began

    def put(self, name: str, rows: list[Row], start: int, end: int, digest: str) -> None:
        self.check()
        self._queue.put((name, rows, start, end, digest))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.check()


def default_writer_threads() -> int:
    cpus = available_cpus()
    return max(1, min(4, cpus // 4))


def run_settings(ckpt: Checkpoint, opts: EncodeOptions, dtype: torch.dtype,
                 part_images: int) -> dict:
    """What the output was computed with; ``--resume`` requires these to match."""
    return {
        "tool": "dsv4enc", "version": __version__, "config": ckpt.config.to_flat(),
        "weights_fingerprint": ckpt.fingerprint, "compute_dtype": str(dtype).removeprefix("torch."),
        "out_dtype": opts.out_dtype, "features": opts.features, "pool": opts.pool,
        "part_images": part_images,
    }


class OutputLayout:
    """Where parts go (a ``.partial`` folder beside a single-file ``--out``, or the ``--out``
    folder itself) and the checks before anything is computed."""

    def __init__(self, out: str, shard_output: bool) -> None:
        self.out = Path(out)
        self.shard_output = shard_output
        self.folder_mode = shard_output or out.endswith(("/", os.sep)) or self.out.is_dir()
        self.parts_dir = self.out if self.folder_mode else self.out.with_name(self.out.name + ".partial")

    def manifest_name(self, dist) -> str:
        """Each rank keeps its own manifest under --shard-output; merged at the end."""
        if self.shard_output and dist is not None:
            return f"_manifest-rank{dist.rank:03d}.json"
        return "_manifest.json"

    def prepare(self, overwrite: bool, resume: bool) -> None:
        out = self.out
        for parent in [out.parent, *out.parent.parents]:
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"cannot write {out}: {parent} is a file, not a folder")
        has_parts = any(self.parts_dir.glob("_manifest*.json"))
        if self.folder_mode and out.exists() and not out.is_dir():
            raise OutputError(f"--out {out} is a file, but a folder output was asked for")
        if self.folder_mode and out.is_dir() and any(out.iterdir()) and not has_parts:
            raise OutputError(f"--out folder {out} is not empty and holds no dsv4enc output; "
                              "choose another path")
        if not resume and not overwrite:
            if not self.folder_mode and out.exists():
                raise OutputError(f"{out} already exists; pass --overwrite to replace it")
            if has_parts and self.folder_mode:
                raise OutputError(f"--out folder {out} already holds dsv4enc output; pass "
                                  "--resume to finish it or --overwrite to replace it")
            if has_parts:
                raise OutputError(f"an unfinished run left {self.parts_dir}; pass --resume to "
                                  "continue it or --overwrite to start over")
        if overwrite and has_parts:
            remove_tree(self.parts_dir)
        if resume and not has_parts and not self.folder_mode and out.is_file():
            raise OutputError(f"{out} is already complete; nothing to resume "
                              "(pass --overwrite to encode again)")

    def discard_if_empty(self) -> None:
        """After a failed run, remove a single-file output's parts folder if no part was
        committed to it (committed parts are kept for --resume)."""
        if not self.folder_mode and not any(self.parts_dir.glob("*.parquet")):
            remove_tree(self.parts_dir)

    def create(self) -> None:
        """Make the parts folder (and missing parents) and check it is writable. Called once
        inputs and weights are known good, so a failed start leaves nothing behind."""
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            probe = self.parts_dir / ".dsv4enc-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None


def _main_then_all(dist, action) -> None:
    """Run ``action`` (an output check) on rank 0 only, then let every rank raise the
    DsvError it raised, so that no rank is left waiting in a collective for a rank 0 that
    gave up (and reports a dead peer instead of the real reason). Also the ranks' barrier."""
    if dist is None:
        action()
        return
    problem = None
    if dist.is_main:
        try:
            action()
        except DsvError as exc:
            problem = exc
    problem = dist.all_gather_object(problem)[0]
    if problem is not None:
        raise problem


def run_encode(opts: EncodeOptions, dist=None) -> RunSummary:
    """Encode ``opts.inputs`` into ``opts.out``. Raises DsvError (setup) or Interrupted."""
    started = time.perf_counter()
    validate(opts)
    device = resolve_device(opts.device, dist)
    dtype = resolve_dtype(opts.dtype, device)
    is_writer_rank = dist is None or dist.is_main or opts.shard_output
    layout = OutputLayout(opts.out, opts.shard_output)
    found = discover(opts.inputs, opts.files_from, opts.image_column, opts.key_column)
    _main_then_all(dist, lambda: layout.prepare(opts.overwrite, opts.resume))
    ckpt = load_model(opts, dtype)
    _main_then_all(dist, layout.create)
    cfg = ckpt.config
    n_workers = default_workers(device) if opts.workers is None else opts.workers
    progress = RunProgress(enabled=opts.progress and (dist is None or dist.is_main))
    stop = _Stop()
    stop.install()
    summary = RunSummary(out=str(opts.out), skipped=found.skipped)
    pool = DecodePool(cfg, n_workers, opts.max_pixels, opts.decode_timeout)  # spawns early
    try:
        model = build_tower(ckpt, device)
        tp = False
        if dist is not None and opts.tp_mode == "weights":
            from .sharding import apply_tensor_parallel
            tp = apply_tensor_parallel(model, dist)
        engine = Engine(model, features=opts.features, attention=opts.attention,
                        out_dtype=torch.float16 if opts.out_dtype == "float16" else torch.float32,
                        cuda_graphs=opts.cuda_graphs, batch_tokens=opts.batch_tokens,
                        max_images=opts.max_images)
        with progress:
            progress.status(f"reading {len(found.items)} image headers")
            planned = read_headers(found.items, cfg, opts.max_pixels, dist,
                                   None if dist is not None else lambda: stop.signum is not None)
            if dist is None and stop.signum is not None:
                raise Interrupted(stop.signum, "nothing was encoded; rerun the same command")
            part_images = images_per_part(cfg, opts)
            settings = run_settings(ckpt, opts, dtype, part_images)
            if opts.shard_output and dist is not None:
                settings["world_size"] = dist.world_size
            store = PartStore(layout.parts_dir, settings, layout.manifest_name(dist))
            parts = plan_parts(planned, part_images, dist if opts.shard_output else None,
                               opts.balance, cfg)
            todo = _resume_filter(store, parts, opts, is_writer_rank, dist, summary)
            schema = output_schema(cfg.output_width(opts.features), opts.out_dtype,
                                   settings, pooled=opts.pool == "mean")
            progress.start(total=len(planned), done=summary.reused)
            single_file = not layout.folder_mode and (dist is None or dist.is_main)
            assembler = (StreamingAssembler(store, [p.name for p in parts], layout.out, schema)
                         if single_file else None)
            writer = (_PartWriter(store, schema, default_writer_threads(), assembler)
                      if is_writer_rank else None)
            runner = _Runner(engine, pool, opts, dist, tp, progress, summary, stop)
            if todo:
                progress.status("capturing CUDA graphs" if engine.graphs_enabled else "encoding")
                engine.fit_budgets(runner.plan(planned, todo))
                engine.prepare()
                progress.status("encoding")
            began = time.perf_counter()
            try:
                for name, start, end, digest, rows in runner.run(planned, todo):
                    if writer is not None:
                        writer.put(name, rows, start, end, digest)
                    del rows  # only the writer holds a finished part while the next is encoded
            except BaseException:
                if assembler is not None:
                    assembler.abort()
                raise
            finally:
                if writer is not None:
                    try:
                        writer.close()
                    except BaseException:
                        if assembler is not None:
                            assembler.abort()
                        raise
                    summary.write_s = writer.seconds
                summary.encode_s = time.perf_counter() - began
            if stop.signum is not None:
                if assembler is not None:
                    assembler.abort()
                raise Interrupted(stop.signum, f"finished parts are kept in {layout.parts_dir}; "
                                  "rerun the same command with --resume to finish")
            if dist is not None:
                dist.barrier()
            if assembler is not None:
                progress.status("writing the final file")
                began = time.perf_counter()
                assembler.finish()
                remove_tree(layout.parts_dir)
                summary.write_s += time.perf_counter() - began
            elif opts.shard_output and dist is not None:
                _merge_manifests(dist, store)
                _sum_rank_counts(dist, summary)
    except (DsvError, Interrupted):
        if dist is None or dist.is_main:
            layout.discard_if_empty()  # so that a corrected rerun is not told to --resume
        raise
    finally:
        stop.restore()
        pool.close()
    stats = engine.stats
    summary.h2d_s, summary.model_s = stats.h2d_s, stats.model_s
    summary.padded_tokens = stats.padded_tokens
    summary.seconds = time.perf_counter() - started
    return summary


@dataclass
class Part:
    name: str
    start: int
    end: int
    indices: list[int]  # the planned items this part covers (all of start..end unless sharded)
    digest: str  # of the keys in start..end, so a resumed run knows the inputs are the same


def plan_parts(planned: Sequence[Planned], part_images: int, shard_dist=None,
               balance: str = "patches", cfg: VisionConfig | None = None) -> list[Part]:
    """Consecutive input ranges of ``part_images`` items. With ``--shard-output`` each rank's
    part holds just its greedy share of the range."""
    parts = []
    for number, start in enumerate(range(0, len(planned), part_images)):
        end = min(start + part_images, len(planned))
        indices = list(range(start, end))
        name = f"part-{number:06d}"
        if shard_dist is not None:
            indices = share_for_rank(planned, indices, shard_dist, balance, cfg)[shard_dist.rank]
            name = f"{name}-rank{shard_dist.rank:03d}"
        parts.append(Part(name, start, end, indices, keys_digest(planned[start:end])))
    return parts


def share_for_rank(planned: Sequence[Planned], indices: list[int], dist,
                   balance: str, cfg: VisionConfig | None = None) -> list[list[int]]:
    """Greedy assignment (SPEC §7) of ``indices`` to ranks; failed items cost nothing."""
    from .sharding import assign_greedy, flops_cost

    if balance == "flops" and cfg is not None:
        costs = [flops_cost(planned[i].n_h, planned[i].n_w, cfg) if planned[i].error is None
                 else 0 for i in indices]
    else:
        costs = [planned[i].tokens if planned[i].error is None else 0 for i in indices]
    return [[indices[j] for j in share] for share in assign_greedy(costs, dist.world_size)]


def _resume_filter(store: PartStore, parts: list[Part], opts: EncodeOptions,
                   is_writer_rank: bool, dist, summary: RunSummary) -> list[Part]:
    """Parts still to encode; with ``--resume``, check settings and skip committed parts.

    Under DP-gathered or TP runs rank 0 owns the manifest and tells the other ranks. Under
    --shard-output each rank has its own, but all ranks must walk the same parts (every batch
    ends in collectives): a range is redone by all when any rank lacks its part. A problem
    on any rank stops every rank."""
    shared = dist is not None and not opts.shard_output
    todo_names, problem = None, None
    if is_writer_rank:
        try:
            todo_names = _uncommitted(store, parts, opts)
        except DsvError as exc:
            problem = exc
    if shared:
        todo_names, problem = dist.all_gather_object((todo_names, problem))[0]
    elif dist is not None:
        mine = set(todo_names or ())
        everyone = dist.all_gather_object(
            ([(p.start, p.end) for p in parts if p.name in mine], problem))
        problem = next((exc for _, exc in everyone if exc is not None), None)
        ranges = {r for todo_ranges, _ in everyone for r in todo_ranges}
        todo_names = [p.name for p in parts if (p.start, p.end) in ranges]
    if problem is not None:
        raise problem
    names = set(todo_names)
    todo = [p for p in parts if p.name in names]
    summary.reused = sum(p.end - p.start for p in parts if p.name not in names)
    return todo


def _uncommitted(store: PartStore, parts: list[Part], opts: EncodeOptions) -> list[str]:
    if not opts.resume or not store.manifest_path.is_file():
        store.create()
        return [p.name for p in parts]
    previous = store.load_existing()
    for key, value in store.settings.items():
        if previous.get(key) != value:
            shown = "weights" if key == "weights_fingerprint" else key.replace("_", " ")
            raise UsageError(f"cannot resume: {shown} differs from the interrupted run "
                             f"({previous.get(key)!r} then, {value!r} now); "
                             "use --overwrite to start over")
    store.save()
    return [p.name for p in parts if not store.committed(p.name, p.start, p.end, p.digest)]


class _Runner:
    """Walks parts -> batches, feeding decoded images to the engine, and yields finished parts
    as ``(name, start, end, digest, rows)``."""

    def __init__(self, engine: Engine, pool: DecodePool, opts: EncodeOptions, dist, tp: bool,
                 progress: RunProgress, summary: RunSummary, stop: _Stop) -> None:
        self.engine, self.pool, self.opts, self.dist = engine, pool, opts, dist
        self.tp = tp
        self.progress, self.summary, self.stop = progress, summary, stop
        self.cfg = engine.cfg
        self.batch_tokens = engine.batch_tokens
        self.gathered = dist is not None and not tp and not opts.shard_output
        self._in_flight: deque[list[tuple[int, Decoded]]] = deque()
        self._plans: list | None = None
        self.sharded = dist is not None and not tp and opts.shard_output

    # -- planning of one part ------------------------------------------------------
    def rank_batches(self, planned: Sequence[Planned], part: Part) -> list[list[list[int]]]:
        """Per rank, the batches (lists of item indices) this part is encoded in.

        Every rank plans every rank's batches, so that all take the same number of steps
        (each step ends in collectives). Under --shard-output the part holds only this
        rank's share, so the shares are recomputed from the whole range (the same greedy
        rule; failed items, cost 0, go last and move nothing else)."""
        indices = range(part.start, part.end) if self.sharded else part.indices
        good = [i for i in indices if planned[i].error is None]
        if self.gathered or self.sharded:
            shares = share_for_rank(planned, good, self.dist, self.opts.balance, self.cfg)
            if self.gathered:
                for rank, share in enumerate(shares):
                    self.summary_loads(rank, sum(planned[i].tokens for i in share))
            else:
                mine = [i for i in part.indices if planned[i].error is None]
                assert shares[self.dist.rank] == mine, "shard plan differs from the part's"
        else:
            shares = [good]
        return [[[share[j] for j in b] for b in
                 pack_bins([planned[i].tokens for i in share], self.batch_tokens,
                           self.opts.max_images)] for share in shares]

    def summary_loads(self, rank: int, load: float) -> None:
        loads = self.summary.rank_loads
        loads.extend([0.0] * (rank + 1 - len(loads)))
        loads[rank] += load

    @property
    def _me(self) -> int:
        return self.dist.rank if self.gathered or self.sharded else 0

    def plan(self, planned: Sequence[Planned], parts: list[Part]) -> list[int]:
        """Plan every part's batches now; returns this rank's batch sizes in tokens."""
        self._plans = [self.rank_batches(planned, part) for part in parts]
        return [sum(planned[i].tokens for i in batch)
                for plan in self._plans for batch in plan[self._me]]

    def run(self, planned: Sequence[Planned], parts: list[Part]) -> Iterator[tuple]:
        plans = self._plans if self._plans is not None else [
            self.rank_batches(planned, part) for part in parts]
        me = self._me
        order = (i for plan in plans for batch in plan[me] for i in batch)
        decoded = self.pool.imap(((i, planned[i].item) for i in order),
                                 window=max(8, 4 * self.pool.n_workers + self.opts.max_images))
        for part, plan in zip(parts, plans):
            rows = {i: _error_row(planned[i]) for i in part.indices if planned[i].error}
            steps = max(len(batches) for batches in plan)
            for step in range(steps):
                batch = plan[me][step] if step < len(plan[me]) else []
                local = self.submit_batch(planned, batch, decoded)
                if len(self._in_flight) > 1:
                    # One batch stays queued on the device while this thread decodes and
                    # packs the next, so the device never waits for the host.
                    local.update(self.collect_batch(planned))
                if self.gathered:
                    local = self.exchange(local)
                rows.update(local)
                if self._stop_agreed():
                    return
            local = {}
            while self._in_flight:
                local.update(self.collect_batch(planned))
            if self.gathered:
                local = self.exchange(local)
            rows.update(local)
            ordered = [rows[i] for i in part.indices]
            self.count(ordered)
            rows = None
            if self.dist is None or self.dist.is_main or self.opts.shard_output:
                yield part.name, part.start, part.end, part.digest, ordered
            ordered = None

    def _stop_agreed(self) -> bool:
        flag = self.stop.signum is not None
        if self.dist is not None:
            flags = self.dist.all_gather_object(self.stop.signum)
            signums = [s for s in flags if s is not None]
            if signums and self.stop.signum is None:
                self.stop.signum = signums[0]
            flag = bool(signums)
        return flag

    def count(self, rows: list[Row]) -> None:
        for row in rows:
            if row.error is None:
                self.summary.encoded += 1
            else:
                self.summary.failed += 1
                kind = row.error.split(":", 1)[0]
                self.summary.errors[kind] = self.summary.errors.get(kind, 0) + 1
        self.progress.advance(len(rows), self.summary)

    # -- one batch ---------------------------------------------------------------
    def submit_batch(self, planned: Sequence[Planned], batch: list[int],
                     decoded: Iterator[tuple[int, Decoded]]) -> dict[int, Row]:
        """Take a batch's decoded images and start them on the engine. Returns the rows of
        images that failed to decode; the others come from ``collect_batch``."""
        rows: dict[int, Row] = {}
        ready: list[tuple[int, Decoded]] = []
        began = time.perf_counter()
        for expected in batch:
            index, result = next(decoded)
            assert index == expected, "decode stream out of step with the plan"
            if result.error is not None:
                rows[index] = _error_row(planned[index], result.error)
            else:
                ready.append((index, result))
        self.summary.decode_wait_s += time.perf_counter() - began
        if not ready:
            return rows
        packed = pack([(patches_tensor(d), d.n_h, d.n_w) for _, d in ready],
                      self.cfg.downsample_ratio, self.opts.features)
        self.engine.submit(packed)
        self._in_flight.append(ready)
        self.summary.tokens += packed.n_tokens
        if self.opts.features == "aligner":
            r2 = self.cfg.downsample_ratio ** 2
            self.summary.merge_pad_tokens += packed.n_rows * r2 - packed.n_tokens
        return rows

    def collect_batch(self, planned: Sequence[Planned]) -> dict[int, Row]:
        """Rows of the oldest batch in flight (waits for the device)."""
        ready = self._in_flight.popleft()
        outputs = self.engine.collect()
        if not self.engine.last_finite:
            for (index, _), out in zip(ready, outputs):
                if not torch.isfinite(out).all():  # name the first image that overflowed
                    raise DsvError(f"embedding of {planned[index].item.key} is not finite in "
                                   f"{self.opts.out_dtype}; rerun with --out-dtype float32")
        return {index: self.make_row(planned[index], d, out)
                for (index, d), out in zip(ready, outputs)}

    def make_row(self, entry: Planned, d: Decoded, out: torch.Tensor) -> Row:
        grid_h, grid_w = output_grid(d.n_h, d.n_w, self.cfg.downsample_ratio, self.opts.features)
        if self.opts.pool == "mean":
            dtype = out.dtype
            out = out.float().mean(0).to(dtype)
        values = out.numpy()
        if out.is_pinned():
            values = values.copy()  # release page-locked memory to the allocator's cache
        return Row(path=entry.item.key, width=d.width, height=d.height, vit_h=d.n_h,
                   vit_w=d.n_w, grid_h=grid_h, grid_w=grid_w, embedding=values)

    def exchange(self, local: dict[int, Row]) -> dict[int, Row]:
        """DP: every rank sends its rows; rank 0 gets them all (one padded all-gather)."""
        from .sharding import gather_rows

        meta = [(i, {**asdict(r), "embedding": None},
                 0 if r.embedding is None else len(r.embedding)) for i, r in local.items()]
        embeddings = [r.embedding for r in local.values() if r.embedding is not None]
        width = self.cfg.output_width(self.opts.features)
        shape = (-1, width)
        flat = (torch.from_numpy(np.concatenate([e.reshape(shape) for e in embeddings]))
                if embeddings else torch.zeros(0, width, dtype=self.engine.out_dtype))
        metas = self.dist.all_gather_object(meta)
        counts = [sum(n for _, _, n in m) for m in metas]
        per_rank = gather_rows(self.dist, flat.to(self.dist.device), counts)
        rows: dict[int, Row] = {}
        for rank_meta, block in zip(metas, per_rank):
            block = block.cpu()
            offset = 0
            for index, fields, n in rank_meta:
                row = Row(**fields)
                if n:
                    emb = block[offset:offset + n]
                    row.embedding = (emb.reshape(width) if self.opts.pool == "mean"
                                     else emb).numpy()
                    offset += n
                rows[index] = row
        return rows


def _error_row(entry: Planned, error: str | None = None) -> Row:
    return Row(path=entry.item.key, width=entry.width, height=entry.height,
               error=error or entry.error)


def _merge_manifests(dist, store: PartStore) -> None:
    """--shard-output: rank 0 lists every rank's parts in one manifest."""
    from .writer import write_json_atomic

    everything = dist.all_gather_object(store.parts)
    if dist.is_main:
        merged = {name: part for parts in everything for name, part in parts.items()}
        write_json_atomic({"settings": store.settings, "parts": merged},
                          store.folder / "_manifest.json")


def _sum_rank_counts(dist, summary: RunSummary) -> None:
    """--shard-output: each rank counted only its own rows; the summary shows them all."""
    counts = dist.all_gather_object((summary.encoded, summary.failed, summary.tokens,
                                     summary.errors))
    summary.encoded = sum(c[0] for c in counts)
    summary.failed = sum(c[1] for c in counts)
    summary.rank_loads = [float(c[2]) for c in counts]
    summary.tokens = sum(c[2] for c in counts)
    merged: dict[str, int] = {}
    for _, _, _, errors in counts:
        for kind, n in errors.items():
            merged[kind] = merged.get(kind, 0) + n
    summary.errors = merged
