"""The encode run: inputs -> headers -> plan -> decode workers -> device -> Parquet parts.

Offline, every image's patch grid is known from its header before any pixel is decoded, so
the whole run is planned up front: items are cut into *parts* (consecutive input ranges, the
unit of commit and resume), each part's images are packed into nearly full batches, and
decode workers stream exactly those images, in that order, a bounded distance ahead of the
device. Parts are written by a background thread. Under torchrun, each part's images are
shared among ranks by the greedy rule of SPEC §7 (or the tower is split, SPEC §8).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import torch

from . import __version__
from .batching import BatchLoop
from .checkpoint import Checkpoint, build_tower, load_checkpoint, random_checkpoint
from .config import VisionConfig
from .decode import Decoded, DecodeStream, patches_tensor
from .device import resolve_device, resolve_dtype, resolve_out_dtype
from .engine import Engine
from .errors import DsvError, Interrupted
from .output import OutputLayout, PartWriter, resume_filter
from .options import EncodeOptions, default_workers, default_writer_threads, validate
from .packing import output_grid
from .planning import (Part, Planned, images_per_part, part_batches, plan_parts,
                       segment_tokens)
from .prefetch import RunSetup
from .progress import RunProgress
from .remote_output import RemoteOutput
from .stopping import StopSignals
from .summary import RunSummary
from .topology import Topology
from .writer import PartStore, Row, StreamingAssembler, output_schema

log = logging.getLogger("dsv4enc")


# ----------------------------------------------------------------------------- set-up

def load_model(opts: EncodeOptions, dtype: torch.dtype) -> Checkpoint:
    if opts.random_init:
        return random_checkpoint(VisionConfig.from_file(opts.config), opts.seed, dtype)
    from .hub import resolve_weights

    return load_checkpoint(resolve_weights(opts.weights), dtype)


def _tower_engine(ckpt: Checkpoint, device: torch.device, opts: EncodeOptions,
                  ranks: Topology) -> Engine:
    """The tower on ``device`` (split over the ranks under tensor parallelism) and its
    Engine."""
    model = build_tower(ckpt, device)
    ranks.split_tower(model, opts.tp_mode)
    if opts.fused:
        from .fusion import fuse_elementwise  # torch.compile's import is slow: only when asked
        fuse_elementwise(model)
    engine = Engine(model, features=opts.features, attention=opts.attention,
                    out_dtype=resolve_out_dtype(opts.out_dtype),
                    cuda_graphs=opts.cuda_graphs, batch_tokens=opts.batch_tokens,
                    max_images=opts.max_images, deterministic=opts.deterministic)
    return engine


# ----------------------------------------------------------------------------- the run

def run_settings(ckpt: Checkpoint, opts: EncodeOptions, dtype: torch.dtype,
                 part_images: int, engine: Engine) -> dict:
    """What the output was computed with; ``--resume`` requires these to match.

    ``batch_invariant`` with ``device`` and ``compute_dtype``: whether each row's bytes are
    independent of its batch, and on what they were computed (the guarantee holds per device
    kind, dtype and software stack, so resume keeps them equal too)."""
    return {
        "tool": "dsv4enc", "version": __version__, "config": ckpt.config.to_flat(),
        "weights_fingerprint": ckpt.fingerprint, "compute_dtype": str(dtype).removeprefix("torch."),
        "device": engine.device.type, "batch_invariant": engine.deterministic,
        "out_dtype": opts.out_dtype, "features": opts.features, "pool": opts.pool,
        "layout": opts.layout,
        "part_images": part_images,
    }


def run_encode(opts: EncodeOptions, dist=None, setup: RunSetup | None = None,
               stop: StopSignals | None = None, stand_in=None) -> RunSummary:
    """Encode ``opts.inputs`` into ``opts.out``. Raises DsvError (setup) or Interrupted.

    ``setup``: what ``prefetch.start_prefetch(opts)`` found and started for these same
    options (the CLI's head start while torch was imported); this call owns and closes it
    (and makes its own without one).
    ``stop``: the caller's installed signal handling; by default this call installs its own
    (from the main thread) and restores the previous handlers when it returns.
    ``stand_in``: computes the rows instead of the tower (``hostbench.NullStage`` measures the
    host side alone): its ``checkpoint`` stands for the weights (config and fingerprint), and
    its ``engine(device, opts)`` for the Engine; no weights are loaded."""
    own_stop = stop is None
    if stop is None:
        stop = StopSignals(immediate=dist is None)  # torchrun ranks stop together, later
        stop.install()
    layout = remote = None
    setup = setup if setup is not None else RunSetup()
    try:
        # An object storage --out is built in a local staging folder and mirrored to the store
        remote = RemoteOutput.for_options(opts, dist)
        if remote is not None:
            opts = remote.opts
        layout = OutputLayout(opts.out, opts.shard_output)
        if remote is not None:
            return remote.run(lambda: _run_encode(opts, dist, setup, stop, layout, stand_in),
                              dist)
        return _run_encode(opts, dist, setup, stop, layout, stand_in)
    finally:
        if layout is not None:
            layout.release()  # the output's lock, held from its checks to the end
        if remote is not None:
            remote.close()
        stop.immediate = False
        if own_stop:
            stop.restore()
        setup.close()


def _run_encode(opts: EncodeOptions, dist, setup: RunSetup, stop: StopSignals,
                layout: OutputLayout, stand_in=None) -> RunSummary:
    started = setup.started if setup.found is not None else time.perf_counter()
    validate(opts)
    device = resolve_device(opts.device, dist)
    dtype = resolve_dtype(opts.dtype, device)
    ranks = Topology(dist, opts.shard_output)
    found = setup.find_inputs(opts, stop if dist is None else None)
    ranks.main_then_all(lambda: layout.prepare(opts))
    ckpt = load_model(opts, dtype) if stand_in is None else stand_in.checkpoint
    stop.immediate = False  # until the try below, which discards an unused output folder
    ranks.main_then_all(layout.create)
    cfg = ckpt.config
    n_workers = default_workers(device.type) if opts.workers is None else opts.workers
    setup.keep_if_planned_for(cfg, device.type)
    if ranks.is_main and not found.items:
        log.warning("no images found in %s (%d other files skipped); the output will have "
                    "no rows", ", ".join(opts.inputs) or opts.files_from, found.skipped)
    progress = RunProgress("auto" if opts.progress and ranks.is_main else "off",
                           opts.log_every)
    summary = RunSummary(out=str(opts.out), skipped=found.skipped,
                         unlisted=len(found.unlisted))
    setup.decode_pool(cfg, n_workers, opts)  # spawned now unless early: workers start meanwhile
    try:
        stop.immediate = dist is None
        stop.check()
        engine = (_tower_engine(ckpt, device, opts, ranks) if stand_in is None
                  else stand_in.engine(device, opts))
        with progress:
            planned = setup.headers(cfg, opts, ranks,
                                    None if dist is not None else stop.requested,
                                    announce=progress.status)
            if dist is None and stop.signum is not None:
                raise Interrupted(stop.signum, "nothing was encoded; rerun the same command")
            part_images = images_per_part(cfg, opts)
            settings = run_settings(ckpt, opts, dtype, part_images, engine)
            if ranks.shard_output:
                settings["world_size"] = ranks.world_size
            store = PartStore(layout.parts_dir, settings, layout.manifest_name(dist))
            parts = plan_parts(planned, part_images, ranks, opts.balance, cfg, segment_tokens=(
                None if ranks.splits_images else  # greedy per part
                segment_tokens(engine.batch_tokens, device.type)))
            todo = resume_filter(store, parts, opts, ranks, summary)
            schema = output_schema(cfg.output_width(opts.features), opts.out_dtype,
                                   settings, pooled=opts.pool == "mean", layout=opts.layout)
            progress.start(total=len(planned), done=summary.reused,
                           tokens=sum(planned[i].tokens for p in todo
                                      for i in range(p.start, p.end)))
            single_file = not layout.folder_mode and ranks.is_main
            assembler = (StreamingAssembler(store, [p.name for p in parts], layout.out, schema)
                         if single_file else None)
            writer = (PartWriter(store, schema, default_writer_threads(), assembler)
                      if ranks.writes else None)
            runner = _Runner(engine, setup, opts, ranks, progress, summary, stop)
            began = time.perf_counter()
            try:
                try:
                    if todo:
                        progress.status("capturing CUDA graphs" if engine.graphs_enabled
                                        else "encoding")
                        engine.fit_budgets(runner.plan(planned, todo))
                        engine.prepare()
                        progress.begin_encoding()
                        began = time.perf_counter()
                    stop.hint = (f"finished parts are kept in {layout.parts_dir}; rerun the "
                                 "same command with --resume to finish")
                    with stop.deferred():  # a signal stops the loop between batches
                        for name, start, end, digest, rows in runner.run(planned, todo):
                            if writer is not None:
                                writer.put(name, rows, start, end, digest)
                            del rows  # only the writer holds a finished part meanwhile
                finally:
                    if writer is not None:
                        with stop.deferred():  # parts in the writer's hands get committed
                            writer.close()
                        summary.write_s = writer.seconds
                        stop.hint = layout.resume_hint(store)  # what was really committed
                    summary.encode_s = time.perf_counter() - began
                    progress.end_encoding()
                stop.check()
                ranks.barrier()
                if assembler is not None:
                    progress.status("writing the final file")
                    began = time.perf_counter()
                    assembler.finish()  # a signal meanwhile aborts it: the parts stay
                    stop.immediate = False  # the output is complete: nothing to stop
                    layout.remove_parts()
                    summary.write_s += time.perf_counter() - began
                elif ranks.sharded:
                    ranks.merge_manifests(store)
                    ranks.sum_rank_counts(summary)
                if ranks.gathered:
                    ranks.sum_rank_tokens(summary, engine.stats.padded_tokens)
            except BaseException:
                if assembler is not None:
                    assembler.abort()  # idempotent; the final file never appears half-written
                raise
    except (DsvError, Interrupted) as exc:
        if ranks.is_main:
            layout.discard_if_empty()  # so that a corrected rerun is not told to --resume
        if isinstance(exc, Interrupted):  # what was done, for --summary-json
            summary.seconds = time.perf_counter() - started
            exc.summary = summary
        raise
    stats = engine.stats
    summary.h2d_s, summary.model_s = stats.h2d_s, stats.model_s
    if not ranks.gathered:
        summary.padded_tokens = stats.padded_tokens  # else summed over the ranks above
    summary.seconds = time.perf_counter() - started
    return summary


class _Runner:
    """Walks parts -> batches, feeding decoded images to the engine, and yields finished parts
    as ``(name, start, end, digest, rows)``."""

    def __init__(self, engine: Engine, setup: RunSetup, opts: EncodeOptions, ranks: Topology,
                 progress: RunProgress, summary: RunSummary, stop: StopSignals) -> None:
        self.engine, self.setup, self.opts, self.ranks = engine, setup, opts, ranks
        self.progress, self.summary, self.stop = progress, summary, stop
        self.cfg = engine.cfg
        self.batch_tokens = engine.batch_tokens
        # tags: (index, planned entry, decoded image)
        self.loop = BatchLoop(engine, opts.pool, name_of=lambda tag: tag[1].item.key,
                              remedy="rerun with --out-dtype float32", copy=False)
        self._plans: list | None = None
        # Progress is counted where rows are made, then summed over ranks at each step: a
        # rank counts the rows it encoded (under TP every rank makes the same rows, so only
        # rank 0 counts), and header failures are counted by whoever owns the part's rows.
        self._counts_encoded = ranks.is_main or ranks.splits_images
        self._counts_header_failures = ranks.is_main or ranks.sharded
        # not yet shown: images, tokens, failed, and the planned tokens of images that then
        # failed to decode (the ETA no longer waits for them)
        self._pending = [0, 0, 0, 0]

    # -- planning of one part ------------------------------------------------------
    def rank_batches(self, planned: Sequence[Planned], part: Part) -> list[list[list[int]]]:
        """Per rank, the batches (lists of item indices) this part is encoded in.

        Every rank plans every rank's batches, so that all take the same number of steps
        (each step ends in collectives). The ranks' shares were planned with the part
        (``plan_parts``); failed items are left out of them here (they are no batch's)."""
        shares = part.shares if part.shares is not None else [part.indices]
        shares = [[i for i in share if planned[i].error is None] for share in shares]
        if self.ranks.gathered:
            for rank, share in enumerate(shares):
                self._add_rank_load(rank, sum(planned[i].tokens for i in share))
        return [part_batches(planned, share, self.batch_tokens, self.opts.max_images)
                for share in shares]

    def _add_rank_load(self, rank: int, load: float) -> None:
        loads = self.summary.rank_loads
        loads.extend([0.0] * (rank + 1 - len(loads)))
        loads[rank] += load

    @property
    def _me(self) -> int:
        return self.ranks.rank if self.ranks.splits_images else 0

    def plan(self, planned: Sequence[Planned], parts: list[Part]) -> list[int]:
        """Plan every part's batches now; returns this rank's batch sizes in tokens."""
        self._plans = [self.rank_batches(planned, part) for part in parts]
        return [sum(planned[i].tokens for i in batch)
                for plan in self._plans for batch in plan[self._me]]

    def run(self, planned: Sequence[Planned], parts: list[Part]) -> Iterator[tuple]:
        plans = self._plans if self._plans is not None else [
            self.rank_batches(planned, part) for part in parts]
        me = self._me
        order = [i for plan in plans for batch in plan[me] for i in batch]
        decoded = self.setup.stream(order, self.opts.max_images)
        for part, plan in zip(parts, plans):
            rows = {i: _error_row(planned[i]) for i in part.indices if planned[i].error}
            if self._counts_header_failures:
                self._note(rows.values())
            steps = max(len(batches) for batches in plan)
            for step in range(steps):
                batch = plan[me][step] if step < len(plan[me]) else []
                try:
                    local = self.submit_batch(planned, batch, decoded)
                except _StoppedWaiting:
                    return  # the part in progress is dropped; finished ones are committed
                local.update(self._rows(self.loop.collect_ready()))
                if self._counts_encoded:
                    self._note(local.values())
                if self.ranks.gathered:
                    local = self._exchange(local)
                rows.update(local)
                if self._stop_agreed():
                    return
            local = self._rows(self.loop.drain())
            if self._counts_encoded:
                self._note(local.values())
            if self.ranks.gathered:
                local = self._exchange(local)
            rows.update(local)
            self._show_progress(self._gather_progress(None))
            ordered = [rows[i] for i in part.indices]
            self.count(ordered)
            rows = None
            if self.ranks.writes:
                yield part.name, part.start, part.end, part.digest, ordered
            ordered = None

    def _stop_agreed(self) -> bool:
        """Whether any rank was signalled; also brings every rank's progress to rank 0 (the
        same collective, so progress costs no extra round trip per batch)."""
        reports = self._gather_progress(self.stop.signum)
        self._show_progress(reports)
        signums = [signum for signum, _ in reports if signum is not None]
        if signums and self.stop.signum is None:
            self.stop.signum = signums[0]
        return bool(signums)

    def _note(self, rows) -> None:
        """Count finished rows for the progress display."""
        for row in rows:
            self._pending[0] += 1
            if row.error is None:
                self._pending[1] += row.vit_h * row.vit_w
            else:
                self._pending[2] += 1

    def _gather_progress(self, signum: int | None) -> list[tuple[int | None, list[int]]]:
        """(signal, progress not yet shown) of every rank; this rank's alone without torchrun."""
        pending, self._pending = self._pending, [0, 0, 0, 0]
        return self.ranks.agree_on_stop(signum, pending)

    def _show_progress(self, reports: list[tuple[int | None, list[int]]]) -> None:
        images, tokens, failed, dropped = (sum(counts[k] for _, counts in reports)
                                           for k in range(4))
        if images:
            self.progress.advance(images, tokens, failed, dropped)

    def count(self, rows: list[Row]) -> None:
        for row in rows:
            if row.error is None:
                self.summary.encoded += 1
            else:
                self.summary.failed += 1
                self.summary.add_error(row.error, row.path)

    # -- one batch ---------------------------------------------------------------
    def _next_decoded(self, decoded: Iterator[tuple[int, Decoded]]) -> tuple[int, Decoded]:
        """The next decoded image. One process: a signal that arrives while it waits (a slow
        or hung decode can take up to --decode-timeout) raises ``_StoppedWaiting`` at once.
        Under torchrun every rank waits, and the ranks agree on stopping after the batch."""
        if self.ranks.dist is not None or not isinstance(decoded, DecodeStream):
            return next(decoded)
        while True:
            item = decoded.next_within(_STOP_POLL_S)
            if item is not None:
                return item
            if self.stop.requested():
                raise _StoppedWaiting

    def submit_batch(self, planned: Sequence[Planned], batch: list[int],
                     decoded: Iterator[tuple[int, Decoded]]) -> dict[int, Row]:
        """Take a batch's decoded images and start them on the engine. Returns the rows of
        images that failed to decode; the others come from ``self.loop``."""
        rows: dict[int, Row] = {}
        ready: list[tuple[int, Decoded]] = []
        began = time.perf_counter()
        for expected in batch:
            index, result = self._next_decoded(decoded)
            assert index == expected, "decode stream out of step with the plan"
            if result.error is not None:
                rows[index] = _error_row(planned[index], result.error)
                if self._counts_encoded:
                    self._pending[3] += planned[index].tokens
            else:
                ready.append((index, result))
        self.summary.decode_wait_s += time.perf_counter() - began
        if not ready:
            return rows
        packed = self.loop.submit([(index, planned[index], d) for index, d in ready],
                                  [(patches_tensor(d), d.n_h, d.n_w) for _, d in ready])
        self.summary.tokens += packed.n_tokens
        if self.opts.features == "aligner":
            r2 = self.cfg.downsample_ratio ** 2
            self.summary.merge_pad_tokens += packed.n_rows * r2 - packed.n_tokens
        return rows

    def _rows(self, done: list[tuple[tuple[int, Planned, Decoded], torch.Tensor]],
              ) -> dict[int, Row]:
        """Rows of collected images (``BatchLoop`` tags and outputs), by input index."""
        return {index: self.make_row(entry, d, out) for (index, entry, d), out in done}

    def make_row(self, entry: Planned, d: Decoded, out: torch.Tensor) -> Row:
        grid_h, grid_w = output_grid(d.n_h, d.n_w, self.cfg.downsample_ratio, self.opts.features)
        return Row(path=entry.item.key, width=d.width, height=d.height, vit_h=d.n_h,
                   vit_w=d.n_w, grid_h=grid_h, grid_w=grid_w, embedding=out.numpy())

    def _exchange(self, local: dict[int, Row]) -> dict[int, Row]:
        """Data parallel: rank 0 gets every rank's rows."""
        return self.ranks.exchange_rows(local, self.cfg.output_width(self.opts.features),
                                        self.opts.pool == "mean", self.engine.out_dtype)


class _StoppedWaiting(Exception):
    """A signal arrived while the encoding loop waited for a decoded image."""


_STOP_POLL_S = 0.1  # how often a wait for a decoded image checks for a signal


def _error_row(entry: Planned, error: str | None = None) -> Row:
    return Row(path=entry.item.key, width=entry.width, height=entry.height,
               error=error or entry.error)
