"""A run's set-up (``RunSetup``): the inputs found, the plan, the decode pool and the decoded
stream, made early (before torch is imported) when the run qualifies, else by the run itself
when it needs them. One holder owns it and closes it once: ``run_encode`` closes the set-up it
is given or makes.

Why early: importing torch takes a second or more of one core (and a GPU's start-up several
more), during which the machine's other cores have nothing to do. The whole plan (headers, parts,
batches) can be made without torch, so the CLI starts the decode workers on the plan's first
images first and imports torch while they work: a short run then finds its first batches
decoded when the model is ready. The plan assumes the device type torch will pick (the CPU
when no GPU device node exists, else CUDA); ``run_encode`` drops it if torch decides
otherwise (or the model's config or batch size differs), and else uses all of it: the inputs,
headers, parts, batches, decode order, pool and stream are each made once, by the same
``RunSetup`` method whoever calls it first.
Only runs whose outcome cannot differ are started early: one process (no torchrun), a fresh
output (no ``--resume`` or ``--update``), a checkpoint folder on disk (or ``--random-init``),
and at most ``MAX_ITEMS`` inputs (the headers are read before the progress bar exists).
Otherwise only the discovered inputs are handed on, so that nothing is walked or read from
stdin twice.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterator

from ..tower.config import VisionConfig
from ..images.decode import DecodePool, Decoded, DecodeStream
from ..errors import DsvError
from ..images.discover import Discovery, discover
from ..engine.defaults import default_batch_tokens
from .options import EncodeOptions, decode_window, default_workers, validate
from .plan import (Part, Planned, decode_order, images_per_part, plan_batches, plan_parts,
                   read_headers, segment_tokens)
from .stopping import StopSignals
from .ranks import Topology, launched_ranks

log = logging.getLogger(__name__)

MAX_ITEMS = 4096


@dataclass
class RunSetup:
    """Inputs found (None until ``find_inputs``), the plan (headers, parts, batches and the
    decode order), the decode pool and the decoded stream. Each is made once, by the method
    that returns it: early by ``start_prefetch`` when the run qualifies, else by the run as
    it goes. The run uses whatever the early start made (``keep_if_planned_for`` drops an
    early plan only when it was made for another model config, device type or batch size)."""

    found: Discovery | None = None
    device_type: str | None = None  # "cpu" (certain), "cuda" (likely) or None (unknown)
    # The run's clock (``time.perf_counter``) starts here: when the set-up was made, or what
    # its maker says (the command line: when the process started).
    started: float = field(default_factory=time.perf_counter)
    cfg: VisionConfig | None = None
    batch_tokens: int | None = None  # what the batches were planned with
    planned: list[Planned] | None = None
    parts: list[Part] | None = None
    batches: list[list[list[int]]] | None = None  # per part to do, per rank (``plan_batches``)
    order: list[int] = field(default_factory=list)  # this process's decode order
    pool: DecodePool | None = None
    decoded: Iterator[tuple[int, Decoded]] | None = None

    @property
    def on_cpu(self) -> bool:
        """The run certainly runs on the CPU."""
        return self.device_type == "cpu"

    @property
    def early(self) -> bool:
        """The plan was made (and decoding started) before the run's model was loaded."""
        return self.planned is not None and self.cfg is not None

    def matches(self, cfg: VisionConfig, device_type: str, batch_tokens: int | None) -> bool:
        """The early plan was made for this model config (the checkpoint's, once loaded),
        the device type torch chose and the batch size the engine runs (None: unknown)."""
        return (self.early and self.cfg == cfg and self.device_type == device_type
                and batch_tokens is not None and self.batch_tokens == batch_tokens)

    def find_inputs(self, opts: EncodeOptions, stop: StopSignals | None) -> Discovery:
        """The inputs, found now unless found early (``stop``: None under torchrun, where
        the ranks stop together)."""
        if self.found is None:
            self.found = discover(opts.inputs, opts.files_from, opts.image_column,
                                  opts.key_column, stop,
                                  table_paths_roots=opts.table_paths_roots,
                                  keep_columns=opts.keep_columns)
        return self.found

    def keep_if_planned_for(self, cfg: VisionConfig, device_type: str,
                            batch_tokens: int | None) -> None:
        """Drop an early plan (and its pool and stream) made for another model config,
        device type or batch size than the run's: the run plans again (and says so)."""
        if self.early and not self.matches(cfg, device_type, batch_tokens):
            log.info("the early plan was made for %s, the run is on %s: planning again",
                     self.device_type, device_type)
            self.close()
            self.cfg = self.batch_tokens = self.planned = self.parts = self.batches = None
            self.pool, self.order = None, []

    def decode_pool(self, cfg: VisionConfig, device_type: str, opts: EncodeOptions) -> DecodePool:
        """The decode pool, of ``--workers`` or the device's default (spawned now unless
        early: its workers start meanwhile)."""
        if self.pool is None:
            workers = default_workers(device_type) if opts.workers is None else opts.workers
            self.pool = DecodePool(cfg, workers, opts.max_pixels, opts.decode_timeout)
        return self.pool

    def headers(self, cfg: VisionConfig, opts: EncodeOptions, ranks: Topology | None,
                should_stop, announce) -> list[Planned]:
        """Every input's header and grid (read now unless early; ``announce(text)`` says
        so first)."""
        if self.planned is None:
            announce(f"reading {len(self.found.items)} image headers")
            self.planned = read_headers(self.found.items, cfg, opts.max_pixels, ranks,
                                        should_stop, opts.decode_timeout)
        return self.planned

    def cut_parts(self, part_images: int, ranks: Topology | None, balance: str,
                  cfg: VisionConfig, segment_tokens: int | None) -> list[Part]:
        """The parts (``plan_parts``), cut now unless early."""
        if self.parts is None:
            self.parts = plan_parts(self.planned, part_images, ranks, balance, cfg,
                                    segment_tokens=segment_tokens)
        return self.parts

    def plan_batches(self, todo: list[Part], batch_tokens: int, max_images: int,
                     rank: int = 0, carried: Collection[int] = ()) -> list[list[list[int]]]:
        """Per part of ``todo``, per rank, its batches, and ``rank``'s decode order
        (planned now unless early; an early plan is made for a fresh output, whose parts
        are all to do). ``carried``: inputs whose rows ``--update`` carries over (in no
        batch; an update is never planned early)."""
        if self.batches is None:
            self.batches = plan_batches(self.planned, todo, batch_tokens, max_images, carried)
            self.batch_tokens = batch_tokens
            self.order = decode_order(self.batches, rank)
        elif len(todo) != len(self.batches):
            raise RuntimeError("an early plan is for a fresh output: every part is to do")
        return self.batches

    def stream(self, max_images: int) -> Iterator[tuple[int, Decoded]]:
        """The decoded images, in the plan's order (started now unless early)."""
        if self.decoded is None:
            planned = self.planned
            self.decoded = self.pool.imap(((i, planned[i].item) for i in self.order),
                                          window=decode_window(self.pool.n_workers, max_images))
        return self.decoded

    def close(self) -> None:
        """Stop the stream and the pool (idempotent)."""
        if isinstance(self.decoded, DecodeStream):
            self.decoded.close()
        self.decoded = None
        if self.pool is not None:
            self.pool.close()


def cuda_impossible() -> bool:
    """True when torch certainly sees no GPU here, judged without importing torch: macOS
    (no CUDA builds), or Linux without NVIDIA device nodes, WSL's /dev/dxg or ROCm's
    /dev/kfd. Anything else counts as possible."""
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")
                    or os.path.exists("/dev/kfd"))
    return False


def expected_device_type(device: str) -> str | None:
    """The device type ``--device`` will resolve to, judged without torch: "cpu" for certain,
    "cuda" when asked for or when a GPU is present (torch has the last word), else None."""
    if device == "cpu" or (device == "auto" and cuda_impossible()):
        return "cpu"
    if device == "auto" or device.startswith("cuda"):
        return "cuda"
    return None


def _early_config(opts: EncodeOptions) -> VisionConfig | None:
    """The tower's config, if it can be read now; errors are left for the normal path to
    report in its own order (output checks come before weights)."""
    path = Path(opts.config) if opts.random_init else Path(opts.weights) / "config.json"
    try:
        return VisionConfig.from_file(path) if path.is_file() else None
    except (DsvError, OSError, ValueError):
        return None


def run_batch_tokens(opts: EncodeOptions, device_type: str) -> int:
    """Patches per batch of a run on ``device_type``: ``--batch-tokens`` or the engine's
    default (what the early plan and the run's engine both use)."""
    return opts.batch_tokens or default_batch_tokens(device_type)


def start_prefetch(opts: EncodeOptions, stop: StopSignals | None = None) -> RunSetup | None:
    """Discover the inputs and, when the run qualifies, plan it and start decoding: the
    same ``RunSetup`` methods the run calls, so that what is made here is not made again.

    Returns None under torchrun (each rank discovers for itself). Raises what discovery and
    option checks raise (the same errors, in the same order, as ``run_encode``), and
    ``Interrupted`` when ``stop`` records a signal meanwhile."""
    if launched_ranks() > 1:
        return None
    validate(opts)
    setup = RunSetup(device_type=expected_device_type(opts.device))
    found = setup.find_inputs(opts, stop)
    device_type = setup.device_type
    if (device_type is None or opts.resume or opts.update or opts.workers == 0
            or len(found.items) > MAX_ITEMS or opts.weights is None and not opts.random_init):
        return setup
    cfg = _early_config(opts)
    if cfg is None:
        return setup
    setup.cfg = cfg
    planned = setup.headers(cfg, opts, None, stop.requested if stop is not None else None,
                            announce=lambda text: None)
    if stop is not None:
        stop.check()  # headers left unread must not be planned as error rows
    batch_tokens = run_batch_tokens(opts, device_type)
    parts = setup.cut_parts(images_per_part(cfg, opts), None, opts.balance, cfg,
                            segment_tokens(batch_tokens, device_type))
    setup.plan_batches(parts, batch_tokens, opts.max_images)
    setup.decode_pool(cfg, device_type, opts)
    setup.stream(opts.max_images)
    log.info("planned %d images in %d parts for %s; decoding started before the model loads",
             len(planned), len(parts), device_type)
    return setup
