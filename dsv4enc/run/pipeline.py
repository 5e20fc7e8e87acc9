"""The encode run: inputs -> headers -> plan -> decode workers -> device -> Parquet parts.

Every image's patch grid is known from its header before any pixel is decoded, so each part
still to do (``plan.cut_parts``) is planned a window ahead of the device (``run/setup.Windows``)
and the decode workers stream exactly its images, in that order; a background thread writes
the parts. Under torchrun the ranks share each part's images (``plan.share_for_ranks``) or
split the tower (``tower/tensor_parallel``)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa
import torch

from .. import storage
from ..engine.defaults import transform_on_device
from ..process import available_cpus
from ..engine.factory import build_engine
from ..tower.checkpoint import Checkpoint, load_checkpoint, random_checkpoint
from ..tower.config import VisionConfig
from ..engine.cpufeatures import auto_cpu_reason
from ..engine.device import resolve_device, resolve_dtype, resolve_out_dtype, resume_compute
from .encoding import PartEncoder
from ..engine.engine import Engine
from ..engine.settings import EngineSettings
from ..errors import AlreadyComplete, DsvError, Interrupted, UsageError, advise
from ..images.decode import DecodePool
from ..images.discover import nothing_found
from ..images.items import is_image_name
from ..output.commit import PartWriter
from ..output.files import output_paths
from ..output.layout import OutputLayout, assembler_for, open_store
from ..output.resume import Resume, ResumeSettings
from ..output.update import (FLAG_OF_SETTING, SHOWN_SETTING, Update, footer_entry,
                              keyed_stamps, recover_switch, row_stamps,
                              write_folder_stamps)
from .options import (PRUNE_SHARE, WORKERS_PER_CPU, EncodeOptions, default_workers,
                      default_writer_threads, validate, validate_launch)
from .plan import Part, cut_parts, images_per_part, output_bytes, segment_tokens
from .setup import LISTED_FIRST, RunSetup, WindowSettings
from ..images.headers import Planned, input_stamps
from .progress import RunProgress
from ..output.remote import RemoteOutput
from .stopping import StopSignals
from .summary import RunSummary
from .ranks import MergedManifest, Topology
from ..output.parts import PartStore, output_schema, part_rows, run_settings

log = logging.getLogger("dsv4enc")


def load_model(opts: EncodeOptions, dtype: torch.dtype) -> Checkpoint:
    if opts.random_init:
        return random_checkpoint(VisionConfig.from_file(opts.config), opts.seed, dtype)
    from ..tower.hub import resolve_weights

    return load_checkpoint(resolve_weights(opts.weights), dtype)


def tower_engine(ckpt: Checkpoint, device: torch.device, opts: EncodeOptions,
                 split=None) -> Engine:
    """The tower on ``device`` in its Engine, as the options ask (for either engine);
    ``split(model)``: the tower's shard of this rank (``Topology.split_tower``)."""
    return build_engine(ckpt, device, opts.engine,
                        out_dtype=resolve_out_dtype(opts.out_dtype), split=split)


def decode_pool(opts: EncodeOptions, cfg: VisionConfig, device: torch.device,
                workers: int) -> DecodePool:
    """The decode workers of a run's engine on ``device`` (for either engine), at most
    ``WORKERS_PER_CPU`` a CPU of the machine that runs them (a Ray actor's own)."""
    if workers > (most := WORKERS_PER_CPU * available_cpus()):  # each is a process to start
        raise UsageError(f"--workers {workers} is more than {WORKERS_PER_CPU} decode processes "
                         f"per CPU ({available_cpus()} here): give at most {most}")
    return DecodePool(cfg, workers, opts.max_pixels, opts.decode_timeout,
                      pixels=transform_on_device(opts.engine.transform, device.type))


def inputs_phrase(inputs: int, listed: bool = True) -> str:
    """The opening line's count: ``1 input``, ``1,024 inputs`` (``10,000+`` while listing)."""
    return f"{inputs:,}{'' if listed else '+'} input{'s' if inputs != 1 else ''}"


def model_and_output(opts: EncodeOptions, cfg: VisionConfig) -> str:
    """The opening line's end, for either engine: the model variant and the output."""
    model = "random weights" if opts.random_init else str(opts.weights)
    return (f"{cfg.model_type} tower of {cfg.n_layers} layers, {opts.engine.features} features, "
            f"{model}; to {opts.out}")


def finishing_flag(opts: EncodeOptions) -> str:
    """The flag that finishes an interrupted run, as its error lines advise it: ``--update``
    for an update, else ``--resume`` (in place of ``--overwrite``, which it contradicts)."""
    if opts.update:
        return "--update"
    return "--resume in place of --overwrite" if opts.overwrite else "--resume"


def resume_settings(opts: EncodeOptions) -> ResumeSettings:
    """How the run commits and resumes (``output/resume.Resume``): --resume, --commit-every
    (each segment is a part under --shard-output), and the options that decide rows besides
    the run's settings (not --decode-timeout: a part with a timed-out row is redone anyway)."""
    return ResumeSettings(resume=opts.resume or opts.update,
                          flag="--update" if opts.update else "--resume",
                          commit_every=None if opts.shard_output else opts.commit_every,
                          row_options={"max_pixels": opts.max_pixels,
                                       "image_column": opts.image_column,
                                       "key_column": opts.key_column,
                                       # None when none: what earlier outputs recorded
                                       "keep_columns": list(opts.keep_columns) or None,
                                       "keep_members": list(opts.keep_members) or None})


@dataclass(frozen=True)
class Computing:
    """What computes a run's rows, as ``PartSource.start`` says once it is up: the output
    records it (``output/parts.run_settings``) and ``--resume`` compares it."""

    config: VisionConfig
    fingerprint: str
    compute_dtype: str  # e.g. "bfloat16"
    device: str  # the device's kind
    batch_invariant: bool
    engine: EngineSettings  # resolved for the device (its batch_tokens plan the batches)
    fused: bool  # the tower runs compiled elementwise kernels (after any eager fallback)

    @classmethod
    def of(cls, ckpt: Checkpoint, dtype: torch.dtype, engine: Engine) -> "Computing":
        """What ``engine``, running ``ckpt`` in ``dtype``, computes with."""
        return cls(ckpt.config, ckpt.fingerprint, str(dtype).removeprefix("torch."),
                   engine.device.type, bool(engine.deterministic), engine.settings,
                   engine.fused)


class PartSource(Protocol):
    """What an engine puts behind the run skeleton (``run_encode`` does the rest once: the
    output's checks, store, resume, writer, assembly, summary, failures and signals):
    ``LocalParts`` or ``ray_engine.RayParts``. ``prepare``: what computes, before the output
    folder is made (returns the line saying what ``--resume`` adopted, else None); ``start``:
    start computing and say with what (``Computing``); ``cut``: the parts, in input order;
    ``planned_tokens``: the progress total's patches now (None: window by window); ``encode``:
    each part to do to ``writer``, ``begin`` called before the first batch; ``finish``: the
    engine's counts into the summary. ``written_elsewhere``: other processes write the parts."""

    written_elsewhere: bool

    def prepare(self, opts: EncodeOptions, layout: OutputLayout, ranks: Topology,
                remote: RemoteOutput | None) -> str | None: ...
    def start(self, setup: RunSetup, progress: RunProgress) -> Computing: ...
    def cut(self, setup: RunSetup, part_images: int, progress: RunProgress,
            stop: StopSignals) -> list[Part]: ...
    def opening_line(self, inputs: int) -> str: ...
    def planned_tokens(self, setup: RunSetup, todo: list[Part]) -> int | None: ...
    def encode(self, setup: RunSetup, output: "OutputPlan", writer: PartWriter | None,
               run: "RunState", begin: Callable[[], None]) -> None: ...
    def finish(self, summary: RunSummary, ranks: Topology) -> None: ...
    def close(self) -> None: ...


def run_encode(opts: EncodeOptions, dist=None, setup: RunSetup | None = None,
               stop: StopSignals | None = None, stand_in=None,
               source: PartSource | None = None) -> RunSummary:
    """Encode ``opts.inputs`` into ``opts.out``. Raises DsvError (setup) or Interrupted.

    ``setup``: what ``setup.start_prefetch(opts)`` listed before torch was imported (made
    here without one); ``source``: the engine (``LocalParts`` by default); both closed here.
    ``stop``: the caller's signal handling (by default installed here, from the main thread,
    and the previous handlers restored). ``stand_in``: computes the rows instead of the tower
    (``bench/host.NullStage``), its ``checkpoint`` for the weights, ``engine(device, opts)``
    for the Engine."""
    own_stop = stop is None
    if stop is None:
        stop = StopSignals(immediate=dist is None)  # torchrun ranks stop together, later
        stop.install()
    layout = remote = None
    setup = setup if setup is not None else RunSetup()
    source = source if source is not None else LocalParts(dist, stand_in)
    try:
        ranks = Topology(dist, opts.shard_output)
        _check_options(opts, ranks)  # before the output is touched: a refusal changes nothing
        storage.set_outage_s(opts.storage_outage_s)
        # An object storage --out is built in a local staging folder and mirrored to the store
        remote = RemoteOutput.for_out(
            opts.out, writer=ranks.writes, inputs=opts.inputs, resume=opts.resume,
            update=opts.update, overwrite=opts.overwrite, shard_output=opts.shard_output,
            rank=ranks.rank, world_size=ranks.world_size, gather=ranks.gather)
        if remote is not None and opts.dry_run:  # its pull and finish write to the store
            raise UsageError("--dry-run needs a local --out (an object storage output is "
                             "synced when the run ends)")
        if remote is not None:
            opts = replace(opts, out=remote.staged_out)
        elif opts.update:  # an update's switch stopped halfway left the output aside
            recover_switch(Path(opts.out))
        layout = OutputLayout(opts.out, opts.shard_output)
        if remote is None:
            summary = _run_encode(opts, ranks, setup, stop, layout, source)
        else:
            layout.max_file_bytes, layout.shown = remote.max_file_bytes, remote.translate
            summary = remote.run(lambda: _upload_stops_at_once(_run_encode(
                opts, ranks, setup, stop, layout, source, remote), stop, remote,
                finishing_flag(opts)), ranks.main_then_all)
    finally:
        source.close()
        if layout is not None:
            layout.release()  # the output's lock, held from its checks to the end
        if remote is not None:
            remote.close()
        stop.immediate = False
        if own_stop:
            stop.restore()
        setup.close()
    summary.seconds = time.perf_counter() - setup.started  # the decode workers' exit too
    return summary


def _check_options(opts: EncodeOptions, ranks: Topology) -> None:
    """Refuse options that make no sense, alone, together or for this launch: first the ranks
    agree on them, so that no rank refuses on its own."""
    ranks.agree_on_settings(rank_settings(opts, {}))
    validate(opts)
    validate_launch(opts, ranks.world_size)
    if ranks.dist is not None and opts.update:
        raise UsageError("--update runs in one process: run it without torchrun")
    if ranks.dist is not None and opts.files_from == "-":  # each would read a share of it
        raise UsageError("--files-from - (stdin) cannot be shared by torchrun ranks: give "
                         "a file")


@dataclass
class RunState:
    """What a run's stages share."""

    opts: EncodeOptions
    ranks: Topology
    layout: OutputLayout
    progress: RunProgress
    summary: RunSummary
    stop: StopSignals
    remote: RemoteOutput | None = None  # the object storage --out the layout stages


def _run_encode(opts: EncodeOptions, ranks: Topology, setup: RunSetup, stop: StopSignals,
                layout: OutputLayout, source: PartSource,
                remote: RemoteOutput | None = None) -> RunSummary:
    """``remote``: the object storage ``--out`` whose staging ``layout`` is, else None."""
    alone = ranks.dist is None
    found = setup.find_inputs(opts, stop if alone else None,
                              output_paths(remote.given if remote is not None else opts.out))
    ranks.main_then_all(lambda: layout.prepare(opts.inputs, opts.files_from,
                                               overwrite=opts.overwrite, resume=opts.resume,
                                               update=opts.update))
    adopted = source.prepare(opts, layout, ranks, remote)
    stop.immediate = False  # until the try below, which discards an unused output folder
    ranks.main_then_all(layout.create)
    progress = RunProgress("auto" if opts.progress and ranks.is_main else "off", opts.log_every)
    summary = RunSummary(out=str(opts.out))
    run = RunState(opts, ranks, layout, progress, summary, stop, remote)
    store = None
    try:
        stop.immediate = alone
        stop.check()
        with progress:
            computes = source.start(setup, progress)
            output = _plan_output(run, setup, source, computes, remote)
            if output is None:  # --dry-run, or a single file that an update leaves as it is
                return summary
            store = output.store
            line = source.opening_line(len(setup.planned))
            # the output as given: a URL, not the staging folder its run writes in
            progress.announce(remote.translate(line) if remote is not None else line)
            if adopted:
                progress.announce(adopted)
            carried = output.carried  # (only an update carries: its todo is a list)
            done = summary.reused + (sum(i in carried for p in output.todo
                                         for i in range(p.start, p.end)) if carried else 0)
            progress.start(total=len(setup.planned) if found.listed else None, done=done,
                           tokens=source.planned_tokens(setup, output.todo))
            _write_output(run, source, setup, output)
    except (DsvError, Interrupted, KeyboardInterrupt) as exc:  # (a second Ctrl-C: at once)
        again = finishing_flag(opts)
        if isinstance(exc, storage.StoreDown):  # a store output's parts: RemoteOutput.run
            local = store is not None and remote is None
            exc.keep(len(store.parts) if local else None, str(layout.parts_dir), again)
        elif again != "--resume" and not isinstance(exc, KeyboardInterrupt):
            advise(exc, again)
        if ranks.is_main:
            layout.discard_if_empty()  # so that a corrected rerun is not told to --resume
        if isinstance(exc, (Interrupted, KeyboardInterrupt, AlreadyComplete)):  # --summary-json
            summary.seconds = time.perf_counter() - setup.started  # from the caller's start
            if alone and not isinstance(exc, AlreadyComplete):  # torchrun: _stop_together
                source.finish(summary, ranks)  # the engine's seconds so far
            exc.summary = summary
        raise
    finally:  # counted as the listing went
        summary.skipped, summary.unlisted = found.skipped, len(found.unlisted)
    source.finish(summary, ranks)
    return summary  # its wall time is set by run_encode, once the decode workers are gone


@dataclass
class OutputPlan:
    """What a run writes. ``todo``: the parts still to encode (a list, or, streaming, each
    part as ``--resume`` judges it); ``update``: an ``--update``'s ``Update``, else None;
    ``keeps_stamps``: whether this rank keeps the input stamps for a later ``--update``;
    ``part_stamps``: a --shard-output rank's, the row stamps of each part it encodes."""

    store: PartStore
    schema: pa.Schema
    todo: Iterable[Part]
    update: Update | None
    keeps_stamps: bool
    row_options: dict
    engine: EngineSettings  # the engine's, resolved (its batch_tokens plan the batches)
    part_stamps: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def carried(self) -> dict[int, int]:
        """Inputs whose rows ``--update`` copies from the old output."""
        return self.update.carried if self.update is not None else {}


def _plan_output(run: RunState, setup: RunSetup, source: PartSource, computes: Computing,
                 remote: RemoteOutput | None) -> OutputPlan | None:
    """The run's settings, schema and store (the old output's under ``--update``), and its
    parts still to encode (``--resume`` judges committed parts by their inputs' stamps).
    None where nothing is written: ``--dry-run``, or an ``--update`` of a single file that
    equals a clean run as it is (the counts are in the summary)."""
    opts, ranks, layout, summary = run.opts, run.ranks, run.layout, run.summary
    cfg, alone = computes.config, ranks.dist is None
    part_images = images_per_part(cfg, opts)
    settings = {**run_settings(cfg, computes.fingerprint, computes.compute_dtype,
                               computes.device, computes.batch_invariant,
                               out_dtype=opts.out_dtype, features=opts.engine.features,
                               pool=opts.pool, layout=opts.layout, fused=computes.fused),
                "part_images": part_images}
    if ranks.shard_output:
        settings["world_size"] = ranks.world_size
    schema = output_schema(cfg.output_width(opts.engine.features), opts.out_dtype,
                           settings, pooled=opts.pool == "mean", layout=opts.layout,
                           kept=setup.found.kept_fields)
    resuming = resume_settings(opts)
    rows_settings = {**settings, **resuming.row_options}
    ranks.agree_on_settings(rank_settings(opts, rows_settings))  # before the ranks part ways
    if opts.resume and not layout.folder_mode:  # a finished file: nothing to do, or refused
        ranks.main_then_all(lambda: _judge_finished(layout, setup, rows_settings, remote, summary))
    # --update of an existing output (None: there is none yet, a plain run)
    update = Update.start(layout.out, layout.folder_mode,
                          remote.stored if remote is not None else None) if opts.update else None
    # Listed whole first: what judges the output's size up front (one object in a store)
    if opts.dry_run or layout.max_file_bytes is not None and not layout.folder_mode:
        setup.more(None)
    setup.more(max(part_images, LISTED_FIRST))
    if ranks.is_main and not setup.planned:
        log.warning(nothing_found(opts.inputs, opts.files_from, setup.found.skipped))
    if update is not None:  # matched before anything is written: a refusal leaves no trace
        setup.more(None)
        if opts.keep_unlisted:
            setup.planned[:] = update.with_unlisted(setup.planned)
        # Matched by stamps alone: only the parts to encode again are read (their headers as
        # the windows plan them), so an update costs its change, not one read per input
        input_stamps(setup.planned)
        update.match(setup.planned, rows_settings, opts.retry_errors)  # or refuses, in a line
        update.count_into(summary)
        if not opts.prune:
            try:
                update.check_drop(PRUNE_SHARE, given_one_by_one(opts))
            except UsageError:
                if not opts.dry_run:
                    raise
                summary.needs_prune = True
    if opts.dry_run:
        summary.dry_run = True
        summary.reused = len(update.carried) if update is not None else 0
        summary.encoded = len(setup.planned) - summary.reused
        return None
    if layout.finished and update is not None and update.unchanged:  # a file left as it is
        summary.reused = len(update.carried)
        return None
    store = open_store(layout, settings, schema, local=remote is None, is_main=ranks.is_main,
                       world_size=ranks.world_size, rank=None if alone else ranks.rank,
                       update=update, rows_settings=rows_settings,
                       written_elsewhere=source.written_elsewhere)
    if remote is not None:
        remote.attach(store, source.written_elsewhere)
    parts = source.cut(setup, part_images, run.progress, run.stop)
    resume = Resume(store, setup.planned, resuming, writes=ranks.writes, agree=ranks.agree_on_todo)
    summary.already_complete = resume.complete
    if remote is not None and ranks.writes:  # the run's manifests replace --overwrite's old ones
        remote.drop_replaced()
    # the output holds a manifest now: a stop says how to go on from what it records
    run.stop.hint = layout.resume_hint(store, finishing_flag(opts))
    todo = _judged(resume, parts, setup, run)
    if update is not None or isinstance(parts, list):  # planned whole: its parts at once
        todo = list(todo)
    if update is not None:  # a folder's unchanged parts are kept as they are
        todo, kept = update.keep_parts(store, todo, setup.planned)
        summary.reused += kept
    return OutputPlan(store, schema, todo, update, ranks.is_main and not ranks.sharded,
                      resuming.row_options, computes.engine)


#: Options each torchrun rank may set for itself: how it shows progress, how many decode
#: workers it runs, how long it waits, and paths that may differ between nodes (the inputs
#: are compared as listed, the weights and config by what they hold, an --out's staging
#: folder is each rank's own); every other option must agree (``rank_settings``).
PER_RANK_OPTIONS = frozenset({"inputs", "files_from", "out", "weights", "config", "workers",
                              "progress", "log_every", "timeout", "storage_outage_s"})


def rank_settings(opts: EncodeOptions, rows_settings: dict) -> dict:
    """What the ranks of one run must share, by the flag that sets each: the options (but
    ``PER_RANK_OPTIONS``; the inputs are compared as they are listed) and the row settings
    the output records (the weights' fingerprint among them)."""
    options = {name: value for name, value in vars(opts).items()
               if name not in PER_RANK_OPTIONS and name != "engine"} | vars(opts.engine)
    shared = {f"--{name.replace('_', '-')}": value for name, value in options.items()}
    shared.update({FLAG_OF_SETTING.get(name) or SHOWN_SETTING.get(name) or name: value
                   for name, value in rows_settings.items()})
    return shared


def _judge_finished(layout: OutputLayout, setup: RunSetup, settings: dict,
                    remote: RemoteOutput | None, summary: RunSummary) -> None:
    """``--resume`` of the finished single file (``layout.finished``), once every input is listed
    and stamped: AlreadyComplete (its rows counted in ``summary`` as reused, as a finished folder's
    are), or a refusal where its settings or inputs changed (``Update.check_finished``)."""
    if not layout.finished:
        return
    setup.more(None)
    input_stamps(setup.planned)
    finished = Update.start(layout.out, False, remote.stored if remote is not None else None)
    try:
        finished.check_finished(setup.planned, settings)
    except AlreadyComplete:
        summary.already_complete = True
        summary.reused = sum(rows for _, _, rows in finished.old.parts)
        summary.reused_failed = sum(error is not None for error in finished.old.column("error"))
        raise


def given_one_by_one(opts: EncodeOptions) -> bool:
    """Whether the inputs were named one file at a time (image files, or a --files-from list),
    where ``--update`` may drop no row unless ``--prune`` says so."""
    return opts.files_from is not None or all(
        os.path.isfile(name) and is_image_name(name) for name in opts.inputs)


def _judged(resume: Resume, parts: Iterable[Part], setup: RunSetup,
            run: RunState) -> Iterator[Part]:
    """What is still to do of each part, as ``--resume`` judges it once its inputs are
    listed (counted in the progress)."""
    for part in parts:
        run.ranks.note_listed(part.start, part.digest.split(".")[0])  # its keys, not their stamps
        todo = resume.judge(part)
        kept = part.end - part.start - sum(p.end - p.start for p in todo)
        run.summary.reused += kept
        if not run.opts.update:  # an update counts the error rows it carries itself
            run.summary.reused_failed = resume.reused_failed
        run.progress.listed(len(setup.planned), setup.found.listed, reused=kept)
        yield from todo
    resume.end(len(setup.planned))
    run.progress.listed(len(setup.planned), True)


def _upload_stops_at_once(summary: RunSummary, stop: StopSignals,
                          remote: RemoteOutput, again: str) -> RunSummary:
    """Once the run is done locally, a signal stops a single file's upload at once (it leaves
    no object; the parts stay in the store for ``again``, the flag that finishes the run)."""
    if not remote.folder_mode:
        stop.immediate = True
        stop.hint = (f"{remote.given} was not uploaded; rerun the same command with "
                     f"{again} to finish (it reuses the parts {remote.parts_url} holds)")
    return summary


def _write_output(run: RunState, source: PartSource, setup: RunSetup,
                  output: OutputPlan) -> None:
    """Encode the parts to do and, once every rank's are committed, finish the output: the
    single file (its assembly counts as writing), the sharded manifest and counts summed over
    the ranks, a folder's stamps. A failed or stopped run leaves its committed parts."""
    store, update, ranks, layout = output.store, output.update, run.ranks, run.layout
    assembler = assembler_for(store, layout, output.schema, is_main=ranks.is_main)
    writer = (PartWriter(store, output.schema, default_writer_threads(), assembler)
              if ranks.writes else None)
    try:
        _encode_parts(run, source, setup, output, writer)
        _stop_together(run, source)
        if run.stop.requested():  # the last progress line says what the summary kept
            run.progress.settle(run.summary)
        run.stop.check()
        # A store that failed its last calls made rows of outages (transient): the run is
        # not complete while it does not answer
        failing = [exc for exc in ranks.gather(storage.failing_store(give_up=True))
                   if exc is not None]
        if failing:
            raise failing[0]
        ranks.barrier()
        stamps = None
        if output.keeps_stamps:  # each row's input stamp, for a later --update
            input_stamps(setup.planned)  # none left unless a part was neither planned nor judged
            stamps = row_stamps((p.item.key, p.stamp) for p in setup.planned)
            if update is not None:
                update.restamp(stamps)
            if assembler is not None:
                assembler.key_values = {**assembler.key_values,
                                        **footer_entry(stamps, output.row_options)}
        if assembler is not None:
            run.progress.status("writing the final file")
            began = time.perf_counter()
            assembler.finish()  # a signal meanwhile aborts it: the parts stay
            run.stop.immediate = False  # the output is complete: nothing to stop
            if run.remote is not None:
                run.remote.sync_parts()  # before they go here: the rerun of a stopped upload
            layout.remove_parts()
            run.summary.write_s += time.perf_counter() - began
        elif ranks.sharded:
            merged = ranks.merge_manifests(store, _rank_stamps(store, output.part_stamps,
                                                               setup.planned))
            ranks.sum_rank_counts(run.summary)
            if merged is not None:  # rank 0: the merged folder's stamps, for a later --update
                _stamp_sharded(merged, output.row_options)
        elif source.written_elsewhere:
            layout.remove_temporaries()  # what killed writers left, never committed
        if layout.folder_mode and stamps is not None:  # the folder is complete
            if update is not None and update.staging is not None:
                update.finish_folder(store, stamps, output.row_options,  # then nothing to stop
                                     switched=lambda: setattr(run.stop, "immediate", False))
            else:
                write_folder_stamps(layout.parts_dir, store, stamps, output.row_options)
    except BaseException:
        if assembler is not None:
            assembler.abort()  # idempotent; the final file never appears half-written
        raise


def _stop_together(run: RunState, source: PartSource) -> None:
    """Torchrun: once the last batch is done, every rank stops where any rank was signalled
    (a signal after the ranks' last agreement, too), and a stopped run's summary counts
    every rank's work, as a finished run's does."""
    ranks = run.ranks
    if ranks.dist is None:
        return
    signals = [signum for signum in ranks.gather(run.stop.signum) if signum is not None]
    if not signals:
        return
    run.stop.signum = run.stop.signum or signals[0]
    if ranks.sharded:
        ranks.sum_rank_counts(run.summary)
    source.finish(run.summary, ranks)


def _rank_stamps(store: PartStore, encoded: dict[str, np.ndarray],
                 planned: Sequence[Planned]) -> dict[str, np.ndarray]:
    """A --shard-output rank's parts' row stamps, by name: those it encoded, as it encoded
    them, and those ``--resume`` kept, from the inputs their entries say they hold
    (``parts.part_rows``), so that the end costs the same however many parts were kept; only
    an entry that does not say (an earlier dsv4enc's) has its keys read back. None for a file
    this rank does not hold (a bucket's, uploaded)."""
    import pyarrow.parquet as pq

    stamps = {}
    for name, part in store.parts.items():
        path = store.folder / part["file"]
        if name in encoded:
            stamps[name] = encoded[name]
        elif path.is_file():
            inputs = planned[part["start"]:part["end"]]
            input_stamps(inputs)  # none left: --resume judged the part by them
            held = part_rows(part)
            if held is not None:
                stamps[name] = row_stamps((inputs[i].item.key, inputs[i].stamp) for i in held)
            else:
                keys = pq.read_table(path, columns=["path"]).column(0).to_pylist()
                stamps[name] = keyed_stamps(keys, inputs)
    return stamps


def _stamp_sharded(merged: MergedManifest, row_options: dict) -> None:
    """A finished sharded folder's stamps, in its rows' order (parts by start, then file, as
    ``--update`` reads them): each rank's part holds its share of a range, in the order its rank
    sent (``_rank_stamps``). A bucket's parts (uploaded, not held here) stay unstamped."""
    parts = sorted(merged.parts.items(), key=lambda item: (item[1]["start"], item[1]["file"]))
    if not all(name in merged.stamps and (merged.folder / part["file"]).is_file()
               for name, part in parts):
        return
    stamps = np.concatenate([np.zeros(0, np.uint64), *(merged.stamps[name] for name, _ in parts)])
    write_folder_stamps(merged.folder, merged, stamps, row_options)


def _encode_parts(run: RunState, source: PartSource, setup: RunSetup, output: OutputPlan,
                  writer: PartWriter | None) -> None:
    """Encode the parts still to do (``source.encode``), handing each finished one to the
    writer; the writer is closed (its parts committed) however that ends."""
    began = [time.perf_counter()]
    layout, stop, summary, progress = run.layout, run.stop, run.summary, run.progress
    again = finishing_flag(run.opts)

    def begin() -> None:
        progress.begin_encoding()
        began[0] = time.perf_counter()

    try:
        stop.hint = layout.encoding_hint(again)
        source.encode(setup, output, writer, run, begin)
    finally:
        if writer is not None:
            with stop.deferred():  # parts in the writer's hands get committed
                writer.close()
            summary.write_s = writer.seconds
            stop.hint = layout.resume_hint(output.store, again)  # what was really committed
        summary.encode_s = time.perf_counter() - began[0]
        progress.end_encoding()


class LocalParts:
    """The local engine (``PartSource``): the tower's Engine in this process (this rank under
    torchrun), the parts planned by ``run/setup.Windows`` and encoded by ``PartEncoder``."""

    written_elsewhere = False

    def __init__(self, dist=None, stand_in=None) -> None:
        self.dist, self.stand_in = dist, stand_in
        self.engine: Engine | None = None

    def prepare(self, opts: EncodeOptions, layout: OutputLayout, ranks: Topology,
                remote: RemoteOutput | None) -> str | None:
        """The device and dtype (``--resume`` adopts the interrupted run's where they are
        ``auto``: ``device.resume_compute``, rank 0's record for every rank), and the weights."""
        dist = self.dist
        device = resolve_device(opts.device, dist.device if dist is not None else None)
        rank = dist.rank if dist is not None else None
        recorded = ranks.gather(layout.interrupted_settings(rank)
                                if opts.resume and ranks.writes else None)[0]
        self.device, self.dtype, adopted = resume_compute(
            device, resolve_dtype(opts.dtype, device), opts.device, opts.dtype, recorded,
            device_fixed=dist is not None)
        self.opts, self.ranks, self.layout = opts, ranks, layout
        self.ckpt = (self.stand_in.checkpoint if self.stand_in is not None
                     else load_model(opts, self.dtype))
        return adopted

    def start(self, setup: RunSetup, progress: RunProgress) -> Computing:
        """The decode pool (its workers start while the tower is built) and the Engine (the
        tower split over the ranks under tensor parallelism)."""
        opts, ckpt, device, ranks = self.opts, self.ckpt, self.device, self.ranks
        self.setup = setup
        workers = default_workers(device.type) if opts.workers is None else opts.workers
        setup.pool = decode_pool(opts, ckpt.config, device, workers)
        engine = self.engine = (
            tower_engine(ckpt, device, opts, lambda model: ranks.split_tower(model, opts.tp_mode))
            if self.stand_in is None else self.stand_in.engine(device, opts))
        return Computing.of(ckpt, self.dtype, engine)

    def cut(self, setup: RunSetup, part_images: int, progress: RunProgress,
            stop: StopSignals) -> Iterator[Part]:
        return cut_parts(setup.planned, part_images, setup.more)  # as they are listed

    def opening_line(self, inputs: int) -> str:
        """Inputs, device, dtype (and why, for ``auto``), the model variant and the output."""
        opts, device, shown = self.opts, self.device, str(self.dtype).removeprefix("torch.")
        if str(opts.dtype) == "auto":
            shown += (f" (--dtype auto: {auto_cpu_reason()})" if device.type == "cpu"
                      else " (--dtype auto)")
        return (f"encoding {inputs_phrase(inputs, self.setup.found.listed)} on {device.type} "
                f"in {shown}; {model_and_output(opts, self.ckpt.config)}")

    def planned_tokens(self, setup: RunSetup, todo: Iterable[Part]) -> int | None:
        return None  # each window adds its own

    def encode(self, setup: RunSetup, output: OutputPlan, writer: PartWriter | None,
               run: RunState, begin: Callable[[], None]) -> None:
        """Encode the parts to do window by window as they are planned."""
        engine, opts, ranks = self.engine, self.opts, self.ranks
        runner = PartEncoder(engine, opts, ranks, run.progress, run.summary, run.stop,
                             output.update)
        planned = setup.planned

        def on_window(k: int, window) -> None:
            sizes = runner.batch_sizes(planned, window.batches)
            run.progress.plan_tokens(window.tokens, last=windows.count == k + 1)
            if k == 0:
                run.progress.status("capturing CUDA graphs" if engine.graphs_enabled
                                    else "encoding")
                # the first window's batches tell the graph budgets; a full batch's is one
                # when later windows come, so that none of their batches is left to run eager
                engine.fit_budgets(sizes + [engine.batch_tokens] * (windows.count != 1))
                engine.prepare()
                begin()

        def list_ahead() -> bool:  # the planner's spare time lists on: the total is known
            setup.more(len(setup.planned) + LISTED_FIRST)
            run.progress.listed(len(setup.planned), setup.found.listed)
            return not setup.found.listed

        cfg, batch_tokens = self.ckpt.config, engine.batch_tokens
        plan = WindowSettings(  # a single file's size is judged from the first window
            cfg, opts, ranks, batch_tokens,
            None if ranks.splits_images else segment_tokens(batch_tokens, self.device.type),
            runner.me, run.summary, carried=output.carried,
            unread=output.update.unlisted if output.update is not None else (),
            should_stop=None if ranks.dist is not None else run.stop.requested,
            check_size=lambda first: self.layout.check_file_size(
                output_bytes(cfg, opts, first) * len(planned) // max(1, len(first))))
        windows = setup.plan_windows(output.todo, plan, opts.engine.max_images,
                                     idle=list_ahead if ranks.world_size == 1 else None)
        with run.stop.deferred():  # a signal stops the loop between batches
            for name, start, end, digest, closes, rows in runner.run(
                    planned, windows.parts(on_window), setup.decoded):
                if writer is not None:
                    if ranks.sharded:  # its rows' stamps, for the folder's (_stamp_sharded)
                        output.part_stamps[name] = keyed_stamps((row.path for row in rows),
                                                                planned[start:end])
                    writer.put(name, rows, start, end, digest, closes=closes)
                del rows  # only the writer holds a finished part meanwhile
        if windows.count is not None:
            run.progress.plan_tokens(0, last=True)  # the last window was not known as such

    def finish(self, summary: RunSummary, ranks: Topology) -> None:
        """The engine's times and padding into ``summary`` (also a stopped run's, so far; none
        before the engine was built)."""
        if self.engine is None:
            return
        stats = self.engine.stats
        summary.h2d_s, summary.model_s = stats.h2d_s, stats.model_s
        if ranks.gathered:
            ranks.sum_rank_tokens(summary, stats.padded_tokens)
        else:
            summary.padded_tokens = stats.padded_tokens

    def close(self) -> None:
        pass
