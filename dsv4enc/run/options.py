"""What ``dsv4enc encode`` can be asked to do, checked, and the defaults that depend on the
machine. Torch-free, so that the CLI can plan and start decoding before torch is imported."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal, get_args

from ..engine.defaults import DEFAULT_POOL, POOLS, Pool
from ..engine.settings import CHOICES as ENGINE_CHOICES, SETTINGS, EngineSettings
from ..errors import SettingsError, UsageError, check_positive, check_seed
from ..process import available_cpus
from ..images.formats import DEFAULT_DECODE_TIMEOUT_S, DEFAULT_MAX_PIXELS
from ..images.sources import SIDECAR_MEMBERS
from ..output import (DEFAULT_LAYOUT, DEFAULT_STORED_DTYPE, LAYOUTS, STORED_DTYPES, Layout,
                      StoredDtype)
from ..storage import OUTAGE_S, read_at

COLLECTIVE_TIMEOUT_S = 300.0  # --timeout: how long a collective waits for a peer rank
COMMIT_EVERY_S = 30.0  # --commit-every: seconds of encoding before finished work is committed
LOG_EVERY_S = 30.0  # --log-every: seconds between progress lines when stderr is not a terminal
PRUNE_SHARE = 0.01  # the share of an output's rows --update may drop without --prune
#: The largest --max-pixels: 2**36 (68.7 gigapixels), 768 times Pillow's default and past
#: any real image (a decoded RGB one that large is 192 GiB), while a decode worker's memory
#: budget (16 bytes a pixel) stays a size that the kernel's rlimit takes.
MAX_PIXELS_BOUND = 1 << 36
#: The most decode processes --workers may start per CPU: more than enough to keep the CPUs
#: busy while some wait on reads; far fewer than a typo's 100000.
WORKERS_PER_CPU = 8

#: How the ranks share the tower: each encodes its own images, or the weights are split.
TpMode = Literal["data", "weights"]
#: What a rank's share of the images is balanced by.
Balance = Literal["patches", "flops"]
BALANCE_CHOICES: tuple[str, ...] = get_args(Balance)
#: Each choice option's values, defined once: ``validate``, the command line's ``--help`` and
#: the Python API (``api.Encoder``, ``batch.BatchEncoder``) read them.
CHOICES: dict[str, tuple[str, ...]] = {
    "out_dtype": STORED_DTYPES, "pool": POOLS, "layout": LAYOUTS,
    "tp_mode": get_args(TpMode), "balance": BALANCE_CHOICES, **ENGINE_CHOICES}
#: ``--engine``: this process encodes, or encoder actors on a Ray cluster do.
EngineKind = Literal["local", "ray"]
ENGINES: tuple[str, ...] = get_args(EngineKind)


@dataclass(init=False)
class EncodeOptions:
    """Everything ``dsv4enc encode`` can be asked to do (the CLI maps its flags onto this)."""

    inputs: list[str]
    out: str
    files_from: str | None = None
    image_column: str | None = None
    key_column: str | None = None
    keep_columns: tuple[str, ...] = ()  # table columns copied into the output rows
    keep_members: tuple[str, ...] = ()  # tar samples' sidecar members copied into the rows
    exclude: tuple[str, ...] = ()  # globs of files and folders a folder's walk leaves out
    table_paths_roots: tuple[str, ...] = ()  # folders table path cells may name files in
    weights: str | None = None
    config: str | None = None
    random_init: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    out_dtype: StoredDtype = DEFAULT_STORED_DTYPE
    pool: Pool = DEFAULT_POOL
    layout: Layout = DEFAULT_LAYOUT  # the embedding column's layout (docs/output-format.md)
    workers: int | None = None
    overwrite: bool = False
    resume: bool = False
    update: bool = False  # encode what the output lacks, drop what is gone (output/update)
    prune: bool = False  # --update may drop more than PRUNE_SHARE of the rows
    retry_errors: bool = False  # --update encodes every error row again, not the transient only
    keep_unlisted: bool = False  # --update keeps the rows of inputs not given, as they are
    dry_run: bool = False  # say what would be encoded, reused and dropped; write nothing
    max_pixels: int = DEFAULT_MAX_PIXELS
    decode_timeout: float = DEFAULT_DECODE_TIMEOUT_S
    shard_output: bool = False
    tp_mode: TpMode = "data"
    balance: Balance = "patches"
    timeout: float = COLLECTIVE_TIMEOUT_S
    part_images: int | None = None
    commit_every: float = COMMIT_EVERY_S
    progress: bool = True
    log_every: float = LOG_EVERY_S
    # how long every call to an object store may fail before the run stops (storage.py)
    storage_outage_s: float = OUTAGE_S
    engine: EngineSettings = field(default_factory=EngineSettings)  # how the tower is run

    def __init__(self, inputs: list[str], out: str, **given: Any) -> None:
        """The options by name; the engine's (``engine/settings.SETTINGS``) may be given by
        name too, in ``engine``'s place or replacing its values."""
        flat = {name: given.pop(name) for name in SETTINGS if name in given}
        given["engine"] = replace(given.get("engine") or EngineSettings(), **flat)
        self.inputs, self.out = inputs, read_at(os.fspath(out))  # ``file://``: its path
        for option in fields(self)[2:]:
            if option.name in given and isinstance(option.default, tuple):  # a list given
                setattr(self, option.name, tuple(given.pop(option.name) or ()))
            elif option.name in given:
                setattr(self, option.name, given.pop(option.name))
            elif option.default_factory is not MISSING:
                setattr(self, option.name, option.default_factory())
            else:
                setattr(self, option.name, option.default)
        if given:
            raise TypeError(f"EncodeOptions takes no option {', '.join(given)}")


def validate(opts: EncodeOptions) -> None:
    """Reject options that make no sense, alone or together."""
    if not opts.inputs and not opts.files_from:
        raise UsageError("no inputs: give folders or image files, or --files-from LIST")
    if opts.resume and opts.overwrite:
        raise UsageError("--resume and --overwrite contradict each other; choose one")
    other = "--overwrite" if opts.overwrite else "--resume"  # the one given, if either is
    if opts.update and (opts.overwrite or opts.resume):
        raise UsageError(f"--update and {other} contradict each other; choose one (--update "
                         "also finishes an interrupted update)")
    if (opts.prune or opts.retry_errors or opts.keep_unlisted) and not opts.update:
        flag = ("--prune" if opts.prune else "--retry-errors" if opts.retry_errors
                else "--keep-unlisted")
        raise UsageError(f"{flag} applies to --update only")
    if opts.keep_unlisted and opts.prune:
        raise UsageError("--keep-unlisted keeps every row that --prune would drop; choose one")
    if opts.dry_run and (opts.resume or opts.overwrite):
        raise UsageError(f"--dry-run shows what a new run or an --update would do; leave out "
                         f"{other}")
    if opts.update and opts.shard_output:
        raise UsageError("--update writes one output from one process; leave out --shard-output")
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
    for name, allowed in CHOICES.items():
        if option(opts, name) not in allowed:
            raise SettingsError(f"--{name.replace('_', '-')} must be one of "
                                f"{', '.join(allowed)}")
    for ext in opts.keep_members:
        if ext not in SIDECAR_MEMBERS:
            raise UsageError(f"--keep-member must be one of {', '.join(SIDECAR_MEMBERS)}, "
                             f"got {ext}")
    for name in ("batch_tokens", "max_images", "max_pixels", "part_images", "log_every",
                 "commit_every"):
        if option(opts, name) is not None:
            check_positive(f"--{name.replace('_', '-')}", option(opts, name),
                           whole=name not in ("log_every", "commit_every"))  # seconds
    check_seed("--seed", opts.seed)
    if opts.max_pixels > MAX_PIXELS_BOUND:
        raise SettingsError(f"--max-pixels must be at most {MAX_PIXELS_BOUND} (2**36), "
                            f"got {opts.max_pixels}")
    if opts.workers is not None and opts.workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {opts.workers}")
    if not opts.storage_outage_s > 0:
        raise UsageError(f"--storage-outage-s must be positive, got {opts.storage_outage_s:g}")
    if not (opts.decode_timeout > 0 and opts.timeout > 0):  # NaN too: no deadline would hold
        raise UsageError("timeouts must be positive")
    if opts.shard_output and opts.tp_mode == "weights":
        raise UsageError("--shard-output applies to --tp-mode data only")


def validate_launch(opts: EncodeOptions, world_size: int) -> None:
    """Reject options that would do nothing in a launch of ``world_size`` processes, unsaid:
    ``--tp-mode weights`` in one encodes with the tower whole. ``--balance`` only decides how
    ranks share the images (one process takes them all): accepted, so that one command serves
    both launches."""
    if opts.tp_mode == "weights" and world_size < 2:
        raise UsageError("--tp-mode weights splits the tower across torchrun ranks: run it "
                         "under torchrun with 2 or more ranks")


def option(opts: EncodeOptions, name: str) -> Any:
    """The option ``name``, the engine's among ``opts.engine``."""
    return getattr(opts.engine if name in SETTINGS else opts, name)


def default_writer_threads() -> int:
    return max(1, min(4, available_cpus() // 4))


def default_workers(device_type: str, cpus: int | None = None) -> int:
    """Decode worker processes when ``--workers`` is not given, on a machine of ``cpus``
    CPUs (default: this process's)."""
    cpus = available_cpus() if cpus is None else cpus
    if device_type == "cuda":
        return max(1, min(cpus - 1, 16))
    # On the CPU the model wants the cores; one decoder keeps it fed on small machines.
    return max(1, cpus // 4)


def decode_window(workers: int, max_images: int) -> int:
    """Images decoded ahead of the device: a batch's worth plus a few per worker."""
    return max(8, 4 * workers + max_images)
