"""The ``dsv4enc`` command line: a thin Typer layer over the pipeline.

Domain errors (setup, options, weights, output) become one line on stderr and a non-zero
exit (README's "Exit codes"), never a traceback."""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import time
from dataclasses import fields
from typing import Any, List, Literal, Optional, get_args, get_origin, get_type_hints

import typer
from typer.core import TyperCommand, TyperGroup

from .version import __version__
from .errors import AlreadyComplete, DsvError, Interrupted, check_positive
from .engine.defaults import DEFAULT_BATCH_TOKENS, FEATURES
from .engine.settings import EngineSettings
from .tower.config import ATTENTION_BACKENDS
from .run import options as defaults  # torch-free: the defaults, each defined once
from .storage import OUTAGE_S, stop_bound_s

#: The engine's defaults (``engine/settings``), which its options show.
ENGINE_DEFAULTS = EngineSettings()

class _BareFlags:
    """A command whose --help shows no type for a flag: it takes no value (Typer would show
    ``<bool>``, which reads as if ``--version true`` were asked for)."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)  # type: ignore[misc]  (the Typer class beside it)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class BareFlagsGroup(_BareFlags, TyperGroup):
    """The ``dsv4enc`` group (its own options: ``--version``, ``--verbose``)."""


class BareFlagsCommand(_BareFlags, TyperCommand):
    """Each ``dsv4enc`` command."""


app = typer.Typer(cls=BareFlagsGroup, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="Encode images with the DeepSeek-V4 or V4.1 vision tower and write "
                  "Parquet.")


def command(name: str | None = None, **settings):
    """``app.command`` with the docstring as help whose paragraphs are each one line, so that
    rich wraps them at the terminal's width (typer keeps a docstring's own line breaks)."""
    def register(function):
        paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
        settings.setdefault("help", "\n\n".join(" ".join(p.split()) for p in paragraphs))
        settings.setdefault("cls", BareFlagsCommand)
        return app.command(name, **settings)(function)
    return register


def choices(*values: str) -> str:
    """The metavar that lists a choice option's values in --help. The values are checked by
    ``options.validate`` (a one-line usage error), not by Click."""
    return f"[{'|'.join(values)}]"


#: When this process started (``time.perf_counter``'s clock), set by ``main`` (each torchrun
#: rank's too) so that a run's wall time counts the interpreter's start and the imports.
_process_started: float | None = None
#: Whether the command owns this process (``main``): only then may a hung stop end it.
_owns_process = False


def fail(message: str, code: int = 1) -> None:
    note(message, "[bold red]error:[/]")
    raise typer.Exit(code)


def note(message: str, label: str = "note:") -> None:
    """One line on stderr that is neither an error nor progress (``label``: rich markup)."""
    from rich.markup import escape

    from .run.progress import stderr_console

    # escape: messages quote paths and backend errors, which may hold "[...]" (not markup)
    stderr_console.print(f"{label} {escape(message)}", highlight=False, soft_wrap=True)


def write_stopped_summary(path: str, exc: BaseException, out: str, status: str) -> None:
    """--summary-json of a run that did not complete (``status``: ``"interrupted"`` by a
    signal, or ``"error"`` with the line it ended with): what it had done (maybe nothing). A
    summary that cannot be written leaves the run's own error line as it is."""
    from .run.summary import RunSummary, write_summary_json

    done = getattr(exc, "summary", None) or RunSummary(out=out)
    with contextlib.suppress(OSError):
        write_summary_json(path, done, status, getattr(exc, "exit_code", 1),
                           str(exc) if status == "error" else None)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"dsv4enc {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                 help="Print the version and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log details (graph capture, "
                                 "backend choice) to stderr."),
) -> None:
    """dsv4enc: batch embeddings from the DeepSeek-V4 and V4.1 vision tower."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


#: ``encode --help``'s panel titles -> the names of their options, in order (``_panel``).
ENCODE_PANELS: dict[str, tuple[str, ...]] = {}


def _named_fields() -> dict[str, tuple[Any, Any]]:
    """The fields an ``encode`` option may be named for, each with its type."""
    found = {}
    for settings in (defaults.EncodeOptions, EngineSettings):
        hints = get_type_hints(settings)
        found.update((field.name, (field, hints[field.name])) for field in fields(settings))
    return found


def option(*flags: str, **settings: Any) -> tuple[Any, Any]:
    """An ``encode`` option named for a field of ``EncodeOptions`` or ``EngineSettings``: its
    type and default are the field's, a choice's values its metavar (``_panel`` reads them)."""
    return None, typer.Option(None, *flags, **settings)


def _panel(title: str, **options):
    """Options of one ``encode --help`` panel (Typer's ``rich_help_panel``), by name: each
    a (type, option) pair, or what ``option`` made, given its field's default and its type
    as Typer takes it (a choice is text, several values a list)."""
    ENCODE_PANELS[title] = ENCODE_PANELS.get(title, ()) + tuple(options)
    named = _named_fields()
    for name, (kind, made) in options.items():
        made.rich_help_panel = title
        if kind is not None:
            continue
        field, kind = named[name]
        made.default = field.default
        if get_origin(kind) is Literal:
            made.metavar = made.metavar or choices(*get_args(kind))
            kind = str
        elif get_origin(kind) is tuple:
            kind = Optional[List[get_args(kind)[0]]]
        else:
            given = [arg for arg in get_args(kind) if arg is not type(None)]
            kind = Optional[given[0]] if len(given) < len(get_args(kind)) else kind
        options[name] = kind, made
    return options


#: ``encode``'s parameters, name -> (type, Typer argument or option), in ``--help``'s order:
#: its signature is built from here, so each one's help and panel are written once, its type
#: and default where its field has them (tests/test_cli.py checks that every option is
#: placed). INPUTS: Typer's "Arguments".
_ENCODE_PARAMETERS: dict[str, tuple[Any, Any]] = {
    "inputs": (List[str], typer.Argument(
        None,
        help="Image folders (walked recursively, sorted), image files, Parquet/Arrow tables "
             "(.parquet, .arrow, .feather) and WebDataset shards (.tar).")),
    **_panel(
        "Inputs",
        files_from=option(
            "--files-from", help="A file listing image paths, one per line ('-' for stdin)."),
        exclude=option(
            "--exclude", metavar="GLOB",
            help="Folders: leave out entries whose name or path matches GLOB (repeatable); "
                 "hidden ones always."),
        image_column=option(
            "--image-column",
            help="Table inputs: the column holding image bytes or {bytes, path} structs "
                 "(default: the only such column)."),
        key_column=option(
            "--key-column",
            help="Table inputs: the column naming each row's path (default: FILE/PATH or "
                 "FILE#ROW); kept too, in its own type."),
        keep_columns=option(
            "--keep-column", metavar="NAME",
            help="Table inputs: copy the column NAME into the output rows, in its own type "
                 "(null for rows not from a table; repeatable)."),
        keep_members=option(
            "--keep-member", metavar="EXT",
            help="Tar shards: copy each sample's EXT member "
                 f"({', '.join(defaults.SIDECAR_MEMBERS)}) as text into a column EXT "
                 "(repeatable)."),
        table_paths_roots=option(
            "--table-paths-root", metavar="DIR",
            help="Table inputs: {bytes: null, path} cells may name image files under DIR too "
                 "(default: the table's folder only; repeatable)."),
        max_pixels=option(
            "--max-pixels",
            help="Images with more pixels are refused (decompression bombs); Pillow's default."),
        decode_timeout=option(
            "--decode-timeout",
            help="Seconds one image may take to decode, or its header to be read, before it is "
                 "given up (an error row)."),
        storage_option=(Optional[List[str]], typer.Option(
            None, "--storage-option", metavar="KEY=VALUE",
            help="Object storage (s3://, gs://, ...) inputs and --out: an option of the file "
                 "system (pyarrow S3FileSystem, or fsspec's), e.g. endpoint_override=host:9000, "
                 "anonymous=true (repeatable). Credentials and endpoints otherwise come from "
                 "the environment and config files.")),
        storage_outage_s=option(
            "--storage-outage-s", metavar="SECONDS", help="Object storage: seconds a store may "
            "fail every call before the run stops (exit 1, parts kept for --resume): within "
            f"this plus {stop_bound_s(0.0, {}):g} s of the store's last answer "
            f"({stop_bound_s(OUTAGE_S, {}):g} s by default)."),
    ),
    **_panel(
        "Model",
        weights=option(
            "--weights", envvar="DSV4ENC_WEIGHTS",
            # \[: a literal bracket, not rich markup
            help="Checkpoint folder or Hub id owner/name (pip install 'dsv4enc\\[hub]'); its "
                 "config.json's model_type, deepseek_v4 or deepseek_v41, picks the variant."),
        config=option(
            "--config", help="Model config JSON for --random-init (configs/ has both variants)."),
        random_init=option(
            "--random-init", help="A random tower of --config's shape (demos, benchmarks)."),
        seed=option("--seed", help="Seed for --random-init."),
        dtype=option(
            "--dtype", metavar=choices("auto", "float32", "bfloat16", "float16"),
            help="Compute dtype (auto: bfloat16 on CUDA; on the CPU the dtype measured "
                 "faster on its kind: bfloat16 on Intel with AMX and on AMD Zen 4 and Zen 5, "
                 "float32 on other CPUs; --resume continues in the interrupted run's)."),
        features=option(
            "--features", help="aligner: LLM-width merged tokens; vit: per-patch ViT features."),
        pool=option(
            "--pool", help="none: every row; mean: one vector per image (retrieval, dedup)."),
    ),
    **_panel(
        "Output",
        out=(str, typer.Option(
            ..., "--out", "-o",
            help="Output Parquet file, or a folder (ending in / or with --shard-output) for a "
                 "part-file dataset.")),
        out_dtype=option("--out-dtype", help="Stored embedding dtype."),
        layout=option(
            "--layout",
            help="embedding column: binary (raw bytes, ~20x cheaper) or nested (float lists "
                 "that SQL tools read)."),
        overwrite=option("--overwrite", help="Replace an existing --out."),
        resume=option("--resume", help="Continue an interrupted run, reusing its committed parts."),
        update=option(
            "--update",
            help="Bring a finished --out up to date: encode new and changed images and failed "
                 "reads, keep the other rows, drop those of images gone."),
        prune=option(
            "--prune", help=f"Let --update drop more than {defaults.PRUNE_SHARE:.0%} of the rows."),
        retry_errors=option("--retry-errors", help="--update: encode every error row again."),
        keep_unlisted=option(
            "--keep-unlisted",
            help="--update: encode only the inputs given; keep every other row as it is."),
        dry_run=option("--dry-run", help="Say what would be encoded, reused, dropped."),
        shard_output=option(
            "--shard-output",
            help="torchrun: each rank writes its own parts under the --out folder."),
        summary_json=(Optional[str], typer.Option(
            None, "--summary-json",
            help="Also write the run's summary here as JSON (at the end, or when a signal stops "
                 "the run).")),
        commit_every=option(
            "--commit-every",
            help="Seconds of encoding between commits (a kill loses about this much)."),
        part_images=option(
            "--part-images",
            help="Inputs a part file holds on average (default: from the model config)."),
    ),
    **_panel(
        "Run control",
        quiet=(bool, typer.Option(
            False, "--quiet", "-q",
            help="Print only errors and, at the end, the output path (on stdout).")),
        log_every=option(
            "--log-every",
            help="Seconds between progress lines when stderr is not a terminal (logs of nohup, "
                 "SLURM)."),
        timeout=option(
            "--timeout",
            help="Seconds a collective may wait for a peer rank before the job fails."),
    ),
    **_panel(
        "Engine",
        device=option(
            "--device",
            help="auto, cpu, cuda or cuda:N (under torchrun: each rank's LOCAL_RANK GPU)."),
        batch_tokens=option(
            "--batch-tokens",
            help=f"Patches per packed batch (default {DEFAULT_BATCH_TOKENS['cuda']} on CUDA, "
                 f"{DEFAULT_BATCH_TOKENS['cpu']} on CPU)."),
        workers=option(
            "--workers", help="Decode processes (default from the CPU count; 0 decodes inline; "
            f"at most {defaults.WORKERS_PER_CPU} per CPU)."),
        attention=option("--attention", help="Attention backend."),
        cuda_graphs=option(
            "--cuda-graphs/--no-cuda-graphs",
            help="Replay captured CUDA graphs (default: on with CUDA)."),
        deterministic=option(
            "--deterministic/--no-deterministic",
            help="Batch-invariant rows: an image's bytes do not depend on its batch, ranks "
                 "or resume. Not with --tp-mode weights."),
        fused=option(
            "--fused/--no-fused",
            help="Fuse RMSNorm, RoPE and SwiGLU with torch.compile (default: on with CUDA); "
                 "rows equal the eager tower's to float rounding."),
        transform=option(
            "--transform",
            help="Where images are resized (same bytes): auto is device on CUDA, host on CPU."),
        tp_mode=option(
            "--tp-mode",
            help="torchrun: data (each rank encodes its images) or weights (the tower split "
                 "across ranks; rows not batch-invariant)."),
        balance=option(
            "--balance",
            help="torchrun load balance by patches, or flops (attention's quadratic term)."),
    ),
    **_panel(
        "Ray",
        engine=(str, typer.Option(
            defaults.ENGINES[0], "--engine", metavar=choices(*defaults.ENGINES),
            help="ray: encoder actors on a Ray cluster encode, this process writes the same "
                 "output (needs dsv4enc\\[ray]; inputs and weights readable on every node).")),
        ray_address=(Optional[str], typer.Option(
            None, "--ray-address", envvar="RAY_ADDRESS",
            help="The cluster to join (default: $RAY_ADDRESS, else a local Ray for the run).")),
        ray_actors=(Optional[int], typer.Option(
            None, "--ray-actors",
            help="Encoder actors (default: one per GPU, else one per node).")),
        ray_gpus_per_actor=(Optional[float], typer.Option(
            None, "--ray-gpus-per-actor",
            help="GPUs per actor (default: 1 when the cluster has GPUs and --device is not "
                 "cpu).")),
        ray_object_store_mb=(Optional[int], typer.Option(
            None, "--ray-object-store-mb", hidden=True,
            help="The local Ray's object store (default: Ray's).")),
    ),
}


def settings_options(settings: type = EngineSettings) -> dict[str, tuple[Any, Any]]:
    """An option of the Engine panel for each engine setting with a ``help`` in its field's
    metadata (``engine/settings``): its flag from its name (a flag pair for a yes/no
    setting), its default and help from the field."""
    options = {}
    for setting in fields(settings):
        if "help" not in setting.metadata:
            continue
        flag = f"--{setting.name.replace('_', '-')}"
        kind = type(setting.default)
        if kind is bool:
            flag = f"{flag}/--no-{flag[2:]}"
        options[setting.name] = (kind, typer.Option(setting.default, flag,
                                                    help=setting.metadata["help"]))
    return options


_ENCODE_PARAMETERS.update(_panel("Engine", **settings_options()))

#: ``encode``'s arguments and options by name (what ``--help`` shows of each).
ENCODE_OPTIONS = {name: info for name, (_, info) in _ENCODE_PARAMETERS.items()}


def _encode_signature(function):
    """``function(ctx, **given)`` with the signature Typer reads its parameters from: the
    context, then ``_ENCODE_PARAMETERS``."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    function.__signature__ = inspect.Signature([
        inspect.Parameter("ctx", kind, annotation=typer.Context),
        *(inspect.Parameter(name, kind, default=info, annotation=annotation)
          for name, (annotation, info) in _ENCODE_PARAMETERS.items())])
    return function


@command()
@_encode_signature
def encode(ctx: typer.Context, **given: Any) -> None:
    """Encode images into a Parquet file of embeddings, one row per image."""
    started = _process_started if _process_started is not None else time.perf_counter()
    from .run.options import EncodeOptions

    # $DSV4ENC_WEIGHTS is a default; --random-init asks for none. (The source is told by its
    # name: Typer 0.26+ carries its own Click, whose ParameterSource is not click's.)
    if given["random_init"] and _source(ctx, "weights") == "ENVIRONMENT":
        given["weights"] = None
    storage_option, summary_json, quiet, engine = (
        given.pop(name) for name in ("storage_option", "summary_json", "quiet", "engine"))
    ray_settings = {name: given.pop(f"ray_{name}")
                    for name in ("address", "actors", "gpus_per_actor", "object_store_mb")}
    opts = EncodeOptions(inputs=list(given.pop("inputs") or []), progress=not quiet, **given)
    ray_opts = None
    if engine == "ray":
        from .run.ray_engine import RayEngineOptions

        ray_opts = RayEngineOptions(**ray_settings)
    elif engine not in defaults.ENGINES:
        fail(f"--engine must be one of {', '.join(defaults.ENGINES)}", 2)
    else:  # a Ray option given to a local run ($RAY_ADDRESS is no option given)
        for name in ray_settings:
            if _source(ctx, f"ray_{name}") == "COMMANDLINE":
                fail(f"--ray-{name.replace('_', '-')} applies to --engine ray only", 2)
    _encode_command(opts, storage_option, quiet, summary_json, started, ray_opts)


def _source(ctx: typer.Context, name: str) -> str | None:
    """Where parameter ``name``'s value came from: ``COMMANDLINE``, ``ENVIRONMENT``, ..."""
    source = ctx.get_parameter_source(name)
    return source.name if source is not None else None


def _encode_command(opts, storage_option: list[str] | None, quiet: bool,
                    summary_json: str | None, started: float, ray_opts=None) -> None:
    """``encode`` with its options built: storage and log settings, signals, the listing (before
    torch is imported), the run, its last lines. ``started``: on ``time.perf_counter``'s clock."""
    from . import storage
    from .process import own_process_pillow_settings, own_process_settings, prefer_jemalloc_pool
    from .run.ranks import launched_rank, launched_ranks
    from .run.setup import RunSetup, start_prefetch
    from .run.stopping import FORCE_EXIT_S, StopSignals

    if summary_json:
        from .run.summary import check_summary_path

        try:
            check_summary_path(summary_json, opts.out)
        except DsvError as exc:  # no summary is written there, nor a stopped run's
            fail(str(exc), exc.exit_code)
    package_log = logging.getLogger("dsv4enc")
    log_level = package_log.level
    if quiet:  # warnings too: only errors (and the output path) are printed
        package_log.setLevel(logging.ERROR)
    dist = prefetch = None
    # SIGINT/SIGTERM from here on stop every phase promptly (exit 130/143). Under torchrun
    # they are only recorded: the ranks agree on stopping between batches.
    # In a process of its own (``main``), a stop that hangs ends the process after a grace.
    stop = StopSignals(immediate=launched_ranks() <= 1,
                       force_exit_s=FORCE_EXIT_S if _owns_process else None)

    def stopped_summary(exc: BaseException, status: str = "interrupted") -> None:
        # the main rank writes it, or (before the ranks have joined) torchrun's rank 0
        if summary_json and (dist.is_main if dist is not None else launched_rank() == 0):
            write_stopped_summary(summary_json, exc, opts.out, status)

    stop.last_words = stopped_summary  # a stop that hangs: the process ends
    stop.install()
    own_process_pillow_settings()  # each open checks --max-pixels itself
    try:
        storage.configure(storage_option)  # decode workers inherit them (environment)
        storage.set_outage_s(opts.storage_outage_s)
        try:
            if ray_opts is not None:  # encoder actors decode and encode
                from .run.ray_engine import run_ray_encode

                summary = run_ray_encode(opts, ray_opts, stop)
            else:
                # before torch is imported: a bad input set fails fast
                prefetch = start_prefetch(opts, stop)
                from .engine.device import resolve_device
                from .run.pipeline import run_encode
                from .run.dist import init_distributed
                import torch

                if opts.device == "cpu" or opts.device == "auto" and not torch.cuda.is_available():
                    prefer_jemalloc_pool()

                dist = init_distributed(opts.device, opts.timeout)
                rank_device = dist.device if dist is not None else None
                with contextlib.suppress(DsvError):  # the run reports it, after the options
                    own_process_settings(resolve_device(opts.device, rank_device))
                setup, prefetch = prefetch or RunSetup(), None  # the run owns it from here
                setup.started = started  # the wall time counts start-up (torch's too)
                summary = run_encode(opts, dist, setup, stop)
        finally:
            stop.immediate = False  # reporting and clean-up are not cut short
        if dist is None or dist.is_main:
            _report(opts, summary, quiet, summary_json)
    except Interrupted as exc:
        stopped_summary(exc)
        fail(str(exc), exc.exit_code)
    except AlreadyComplete as exc:  # the same outcome as a finished folder's --resume
        if dist is None or dist.is_main:
            _report(opts, exc.summary, quiet, summary_json)
    except DsvError as exc:
        stopped_summary(exc, "error")
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:  # a second Ctrl-C: the run stopped at once, wherever it was
        stopped = Interrupted(signal.SIGINT, stop.hint)
        stopped.summary = getattr(exc, "summary", None)  # what was done, where a stage kept it
        stopped_summary(stopped)
        fail(str(stopped), stopped.exit_code)
    finally:
        if prefetch is not None:
            prefetch.close()
        if dist is not None:
            from .run.dist import shutdown

            shutdown(dist)
        stop.restore()
        package_log.setLevel(log_level)  # in-process callers (tests) run more commands


def _report(opts, summary, quiet: bool, summary_json: str | None) -> None:
    """A completed run's last lines, and its ``--summary-json``."""
    from .run.summary import dry_run_line, print_summary, write_summary_json

    unwritten = None
    if summary_json:
        try:
            write_summary_json(summary_json, summary)
        except OSError as exc:
            cause = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else exc
            unwritten = (f"--summary-json {summary_json} could not be written ({cause}); the "
                         f"output {summary.out} is complete")
    if summary.dry_run:
        typer.echo(dry_run_line(summary))
    elif quiet:
        if not (summary.encoded or summary.failed or summary.reused):
            from .images.discover import nothing_found

            # an empty run says so under --quiet too (the run's own warning is hidden)
            line = nothing_found(opts.inputs, opts.files_from, summary.skipped)
            typer.echo(f"WARNING dsv4enc: {line}", err=True)
        typer.echo(summary.out)
    else:
        print_summary(summary)
        if opts.resume and summary.reused and not summary.encoded + summary.failed:
            note(f"{summary.out} was already complete; nothing to resume"
                 if summary.already_complete else f"nothing was left to encode: {summary.out} "
                 "was finished from the parts an earlier run committed")
    if unwritten:  # the rows are committed; the report asked for is missing
        fail(unwritten, SUMMARY_UNWRITTEN_EXIT)


#: The exit code of a run that completed but could not write its ``--summary-json``: a setup
#: error's (README's table), as a script that asked for the report must not read it as done.
SUMMARY_UNWRITTEN_EXIT = 1


@command()
def extract(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder or Hub id (owner/name)."),
    out: str = typer.Option(..., "--out", "-o", help="Folder for the vision-only checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace an earlier extract's files in --out."),
) -> None:
    """Write a vision-only checkpoint: the tower's tensors as stored, one model.safetensors."""
    from .tower.export import extract_tower

    try:
        done = extract_tower(checkpoint, out, overwrite=overwrite)
    except DsvError as exc:
        fail(str(exc), exc.exit_code)
    typer.echo(f"wrote {done.tensors} tower tensors ({done.bytes / 2**20:.1f} MiB) to "
               f"{done.folder}")


@command("inspect")
def inspect_command(
    output: str = typer.Argument(..., help="An output Parquet file or dataset folder (a path "
                                 "or a URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON (with "
                                 "--errors: JSON lines)."),
    errors: bool = typer.Option(False, "--errors", help="Print every failed row: its path "
                                "and error."),
    errors_list: Optional[str] = typer.Option(
        None, "--errors-list", metavar="FILE",
        help="Write the failed rows' paths to FILE, a list for encode --files-from."),
    storage_option: Optional[List[str]] = typer.Option(
        None, "--storage-option", metavar="KEY=VALUE",
        help="An option of the store's file system, as encode takes it (repeatable)."),
) -> None:
    """Summarize an output: rows, failures, widths, dtype, grids, metadata, size on disk."""
    if errors_list == "-":  # encode --files-from - would read standard input, not this file
        fail("--errors-list -: give a file (standard output is not one; --errors prints the "
             "failed rows there)", 2)
    try:
        from .storage import options_of

        options_of(storage_option)  # a malformed one is refused, as encode does, local or not
        if errors or errors_list:
            _inspect_errors(output, storage_option, as_json, errors, errors_list)
            return
        from .output.inspect import render, summarize

        summary = summarize(output, storage_option)
    except DsvError as exc:
        fail(str(exc), exc.exit_code)
    except OSError as exc:
        from .storage import describe

        fail(f"cannot read {describe(output, exc)}")
    if as_json:
        typer.echo(json.dumps(summary.as_dict(), indent=1))
    else:
        render(summary)


def _inspect_errors(output: str, storage_option: list[str] | None, as_json: bool,
                    show: bool, errors_list: str | None) -> None:
    """``inspect --errors`` (every failed row on stdout) and ``--errors-list FILE``."""
    from .output.inspect import failed_rows, inspected, write_errors_list

    rows = failed_rows(inspected(output, storage_option))
    if show:
        rows = _echoed(rows, as_json)
    if errors_list is None:
        collections.deque(rows, maxlen=0)
        return
    written, unlisted, containers, keyed = write_errors_list(rows, errors_list)
    note(f"wrote {written} failed path{'s' if written != 1 else ''} to {errors_list}"
         + (f" ({containers} container{'s' if containers != 1 else ''}: a tar shard or "
            "table is named once for its failed rows, and read again whole)"
            if containers else "")
         + (f"; {unlisted} left out (a newline, or blanks at an end, fit no line)"
            if unlisted else "")
         + (f"; once fixed, retry them with encode --files-from {errors_list} --update "
            "--keep-unlisted, run where the paths start" if written else "")
         + (f"; {keyed} row{'s' if keyed != 1 else ''} of a table keyed by --key-column "
            "left out (its key names neither a file nor its table): once fixed, retry "
            f"{'them' if keyed != 1 else 'it'} by rerunning the original command with "
            "--update --retry-errors" if keyed else ""))


def _echoed(rows, as_json: bool):
    """``rows`` (path, error, keyed), each printed as it passes: tab-separated, the path
    escaped as error lines show keys (``printable``: a newline or tab in a key would break
    the line), or a JSON line."""
    from .images.discover import printable

    for path, error, keyed in rows:
        typer.echo(json.dumps({"path": path, "error": error}) if as_json
                   else f"{printable(path)}\t{error}")
        yield path, error, keyed


@command(short_help="Time the engine, or with --host the host side alone.")
def bench(
    config: Optional[str] = typer.Option(None, "--config", help="Model config JSON (a random "
                                         "tower of this shape is timed)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16."),
    images: str = typer.Option("synthetic:mix", "--images", help="A folder of images, or "
                               "synthetic:mix[:N] (photo sizes 300x300 to 2000x1500) or "
                               "synthetic:WxH:N."),
    batch_tokens: Optional[str] = typer.Option(None, "--batch-tokens", help="Comma-separated "
                                               "token budgets to time."),
    graphs: str = typer.Option("auto", "--graphs", help="Comma-separated: auto, on, off."),
    attention: str = typer.Option("auto", "--attention", metavar=choices(*ATTENTION_BACKENDS),
                                  help="Attention backend."),
    features: str = typer.Option(ENGINE_DEFAULTS.features, "--features",
                                 metavar=choices(*FEATURES),
                                 help="The rows timed, as encode's --features."),
    max_images: int = typer.Option(ENGINE_DEFAULTS.max_images, "--max-images",
                                   help="Images per batch at most."),
    repeat: int = typer.Option(2, "--repeat", help="Rounds per measurement (best is kept)."),
    naive_images: Optional[int] = typer.Option(None, "--naive-images", help="Images for the "
                                               "naive one-at-a-time loop (default: all)."),
    e2e: bool = typer.Option(False, "--e2e", help="Also time the whole encode pipeline."),
    cli: bool = typer.Option(False, "--cli", help="Also time 'dsv4enc encode' in a fresh "
                             "process, start-up included (random weights saved once)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the rows here."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads."),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="Keep synthetic images "
                                          "here (default: a temporary folder)."),
    host: bool = typer.Option(False, "--host", help="Time the host side alone: the whole "
                              "encode pipeline with the model replaced by a null stage (no "
                              "GPU needed); images/s per host core, images per CPU-second "
                              "(whole run and steady state) and where the time goes."),
    outputs: str = typer.Option("file,folder", "--outputs", help="--host and --e2e: the "
                                "outputs to time, file and/or folder."),
    fused: str = typer.Option("off", "--fused", help="Comma-separated: off, on (compiled "
                              "elementwise kernels, as 'encode --fused'), for the model "
                              "rows and the --e2e runs."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Decode processes of the "
                                          "--host, --e2e and --cli runs (default: as "
                                          "'encode' picks; --host: as for a CUDA run)."),
    dtype_check: bool = typer.Option(False, "--dtype-check", help="Time float32 and bfloat16 "
                                     "matmuls on this CPU and say what --dtype auto picks."),
) -> None:
    """Time the engine, or with --host the host side alone.

    The engine: img/s, tokens/s, FLOP/s, the fraction of the matmul ceiling measured in the
    same process, padding waste, the time split, and the speed-up over a naive loop. With
    --host: the host's capacity (decoding and writing, with a null model stage). With
    --dtype-check: this CPU's float32 and bfloat16 rates and what --dtype auto picks."""
    try:  # before any timing: a count of 0 or less means nothing (a negative, torch's traceback)
        budgets = [check_positive("--batch-tokens", int(t) if t.strip().lstrip("-").isdigit()
                                  else t) for t in batch_tokens.split(",")] \
            if batch_tokens else None
        for name, value in (("--max-images", max_images), ("--repeat", repeat),
                            ("--threads", 1 if threads is None else threads),
                            ("--naive-images", 1 if naive_images is None else naive_images)):
            check_positive(name, value)
    except ValueError as exc:
        fail(f"bad benchmark option: {exc}", 2)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if config is None and not dtype_check:
        fail("bench needs --config (or --dtype-check)", 2)
    folder = os.path.dirname(os.path.abspath(json_out)) if json_out else None
    if json_out and (os.path.isdir(json_out) or not os.access(folder, os.W_OK)):
        # refused before the timing, at whose end the write would fail in a traceback
        fail(f"--json {json_out}: " + ("a folder, not a file" if os.path.isdir(json_out)
                                      else f"its folder {folder} is missing or read-only"))
    if json_out and os.path.lexists(json_out) and not _is_bench_json(json_out):
        fail(f"--json {json_out} exists and is not a bench's JSON (dsv4enc replaces only what "
             "it wrote); choose another path")
    try:
        if dtype_check:
            from .bench.dtype_check import dtype_check_command

            dtype_check_command(json_out)
            return
        if host:
            from .bench.host import host_bench_command

            host_bench_command(config, images, outputs.split(","), workers, json_out)
            return
        from .bench.throughput import parse_on_off, print_results, run_bench

        rows = run_bench(config, device, dtype, images, budgets,
                         parse_on_off(graphs, True, "--graphs"), attention, features, max_images, repeat=repeat,
                         naive_images=naive_images, e2e=e2e, workers=workers,
                         workdir=workdir, cli=cli, fused=parse_on_off(fused, option="--fused"),
                         e2e_outputs=outputs.split(","))
    except (KeyError, ValueError) as exc:
        fail(f"bad benchmark option: {exc}", 2)
    except DsvError as exc:
        fail(str(exc), exc.exit_code)
    print_results(rows)
    if json_out:
        with open(json_out, "w") as handle:
            json.dump(rows, handle, indent=1, default=str)


def _is_bench_json(path: str) -> bool:
    """Whether ``path`` is a regular file that a bench wrote (its rows, --host's, or
    --dtype-check's figures): the only file that --json replaces."""
    try:
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 1 << 20:
            return False
        with open(path, "rb") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return False
    if isinstance(data, dict):
        return "faster_here" in data
    return isinstance(data, list) and all(isinstance(row, dict) and ("mode" in row or "transform"
                                                                      in row) for row in data)


def main() -> None:
    """Console-script entry point: once the command has finished (output committed, workers
    shut down), ``os._exit`` after flushing stdio and logging, as tearing down an interpreter
    that imported torch is slow. In-process callers (tests, scripts) use ``app`` instead."""
    global _process_started, _owns_process
    from .process import process_age

    _owns_process = True
    if (age := process_age()) is not None:
        _process_started = time.perf_counter() - age
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code or 0)
