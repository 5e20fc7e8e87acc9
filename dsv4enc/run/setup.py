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
otherwise, and uses the decoded stream only if its order is the one it would have asked for.
Only runs whose outcome cannot differ are started early: one process (no torchrun), a fresh
output (no ``--resume`` or ``--update``), a checkpoint folder on disk (or ``--random-init``), and at most
``MAX_ITEMS`` inputs (the headers are read before the progress bar exists). Otherwise only
the discovered inputs are handed on, so that nothing is walked or read from stdin twice.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..tower.config import VisionConfig
from ..images.decode import DecodePool, Decoded, DecodeStream
from ..errors import DsvError
from ..images.discover import Discovery, discover
from ..engine.defaults import default_batch_tokens
from .options import EncodeOptions, decode_window, default_workers, validate
from .plan import (Planned, batch_order, images_per_part, plan_parts, read_headers,
                       segment_tokens)
from .stopping import StopSignals
from .ranks import Topology, launched_ranks

log = logging.getLogger(__name__)

MAX_ITEMS = 4096


@dataclass
class RunSetup:
    """Inputs found (None until ``find_inputs``), and the plan, pool and decode stream: made
    early by ``start_prefetch`` when the run qualifies, else by the run as it goes."""

    found: Discovery | None = None
    device_type: str | None = None  # "cpu" (certain), "cuda" (likely) or None (unknown)
    # The run's clock (``time.perf_counter``) starts here: when the set-up was made, or what
    # its maker says (the command line: when the process started).
    started: float = field(default_factory=time.perf_counter)
    cfg: VisionConfig | None = None
    planned: list[Planned] | None = None
    order: list[int] = field(default_factory=list)
    pool: DecodePool | None = None
    decoded: DecodeStream | None = None

    @property
    def on_cpu(self) -> bool:
        """The run certainly runs on the CPU."""
        return self.device_type == "cpu"

    def matches(self, cfg: VisionConfig, device_type: str) -> bool:
        """The plan was made for this model config (the checkpoint's, once loaded) and the
        device type torch chose."""
        return self.planned is not None and self.cfg == cfg and self.device_type == device_type

    def find_inputs(self, opts: EncodeOptions, stop: StopSignals | None) -> Discovery:
        """The inputs, found now unless found early (``stop``: None under torchrun, where
        the ranks stop together)."""
        if self.found is None:
            self.found = discover(opts.inputs, opts.files_from, opts.image_column,
                                  opts.key_column, stop,
                                  table_paths_roots=opts.table_paths_roots)
        return self.found

    def keep_if_planned_for(self, cfg: VisionConfig, device_type: str) -> None:
        """Drop an early plan (and its pool and stream) made for another model config or
        device type than the run's: the run starts over."""
        if self.planned is not None and not self.matches(cfg, device_type):
            self.close()
            self.planned, self.pool, self.order = None, None, []

    def decode_pool(self, cfg: VisionConfig, workers: int, opts: EncodeOptions) -> DecodePool:
        """The decode pool (spawned now unless early: its workers start meanwhile)."""
        if self.pool is None:
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

    def stream(self, order: list[int], max_images: int) -> Iterator[tuple[int, Decoded]]:
        """Decoded images in ``order``: the early stream when it follows that order (else it
        is stopped), or a new one from the pool."""
        stream, self.decoded = self.decoded, None
        if stream is not None and order == self.order:
            return stream
        if stream is not None:
            stream.close()
        planned = self.planned
        return self.pool.imap(((i, planned[i].item) for i in order),
                              window=decode_window(self.pool.n_workers, max_images))

    def close(self) -> None:
        """Stop the stream and the pool (idempotent)."""
        if self.decoded is not None:
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


def start_prefetch(opts: EncodeOptions, stop: StopSignals | None = None) -> RunSetup | None:
    """Discover the inputs and, when the run qualifies, plan it and start decoding.

    Returns None under torchrun (each rank discovers for itself). Raises what discovery and
    option checks raise (the same errors, in the same order, as ``run_encode``), and
    ``Interrupted`` when ``stop`` records a signal meanwhile."""
    if launched_ranks() > 1:
        return None
    validate(opts)
    found = discover(opts.inputs, opts.files_from, opts.image_column, opts.key_column, stop,
                     table_paths_roots=opts.table_paths_roots)
    device_type = expected_device_type(opts.device)
    prefetch = RunSetup(found, device_type)
    if device_type is None:
        return prefetch
    workers = default_workers(device_type) if opts.workers is None else opts.workers
    if (opts.resume or opts.update or workers == 0 or len(found.items) > MAX_ITEMS
            or opts.weights is None and not opts.random_init):
        return prefetch
    cfg = _early_config(opts)
    if cfg is None:
        return prefetch
    planned = read_headers(found.items, cfg, opts.max_pixels,
                           should_stop=stop.requested if stop is not None else None,
                           timeout_s=opts.decode_timeout)
    if stop is not None:
        stop.check()  # headers left unread must not be planned as error rows
    batch_tokens = opts.batch_tokens or default_batch_tokens(device_type)
    parts = plan_parts(planned, images_per_part(cfg, opts),
                       segment_tokens=segment_tokens(batch_tokens, device_type))
    order = batch_order(planned, parts, batch_tokens, opts.max_images)
    pool = DecodePool(cfg, workers, opts.max_pixels, opts.decode_timeout)
    prefetch.cfg, prefetch.planned, prefetch.order, prefetch.pool = cfg, planned, order, pool
    prefetch.decoded = pool.imap(((i, planned[i].item) for i in order),
                                 window=decode_window(workers, opts.max_images))
    log.info("planned %d images in %d parts for %s; decoding started before the model loads",
             len(planned), len(parts), device_type)
    return prefetch
