"""``dsv4enc encode --engine ray``: the local run's plan and output, with the encoding done by
encoder actors on a Ray cluster (needs ``dsv4enc[ray]``).

The driver runs the local run's skeleton (``pipeline.run_encode`` with ``RayParts`` behind it).
Each part goes to an encoder actor (``SegmentEncoder``: the local run's Engine, decode pool and
``run/encoding.PartEncoder``), which reads the part's images itself (only item locators
travel), writes the part file (``output/parts.write_part``) and sends back only its manifest
entry and counts; the driver commits the entries in input order and never holds a row.

Exactly once: the driver commits each part once, whatever Ray retried. A killed actor is
restarted (``MAX_RESTARTS``) and its calls retried (``MAX_TASK_RETRIES``): rows are
batch-invariant, so a retried part gives the same bytes, and a file a killed actor wrote has a
temporary name no manifest lists."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import time
import warnings
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import storage
from ..errors import DsvError, Interrupted, UsageError
from ..images.headers import Planned, inputs_digest
from ..images.sources import attach_held
from ..pausepoints import pause
from ..process import available_cpus
from .options import EncodeOptions, decode_window, default_workers, validate
from .plan import Part, output_bytes, part_batches, segment_tokens
from .ranks import Topology, launched_ranks
from .stopping import StopSignals
from .summary import RunSummary

log = logging.getLogger("dsv4enc")

#: How often Ray restarts a dead encoder actor, and retries its call, before the run fails:
#: one crash is absorbed, but a segment that kills every actor it reaches does not loop.
MAX_RESTARTS = 4
MAX_TASK_RETRIES = 4
#: Parts in flight per actor: one encoding, one queued behind it (so an actor never waits
#: for the driver), bounding what the object store and the driver hold.
IN_FLIGHT_PER_ACTOR = 2
#: Calls per actor that a run of few parts is cut into (at segment bounds), so that no actor
#: waits while another encodes the only part.
CALLS_PER_ACTOR = 4
#: How long a wait for a part's report runs before the driver looks for a signal.
POLL_S = 0.1
#: Seconds a joined cluster's address has to accept a connection: ``ray.init`` retries an
#: unreachable one for minutes, in C++, where no signal reaches the driver.
JOIN_PROBE_S = 5.0
#: The environment an encoder actor gets from the driver (a remote cluster's workers do not
#: inherit it): storage options and endpoints, and a test's pause points (``pausepoints``).
FORWARDED_ENV = (*storage.SETTINGS_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION", "DSV4ENC_PAUSE_AT", "DSV4ENC_PAUSE_DIR")


@dataclass
class RayEngineOptions:
    """``--ray-address`` and the actor pool. ``address``: None is ``RAY_ADDRESS``, else a local
    Ray started (and shut down) for the run. ``actors``: default one per GPU when the actors
    get GPUs, else one per node. ``gpus_per_actor``: default 1 when the cluster has GPUs and
    ``--device`` is not cpu, else 0. Each actor gets the cluster's CPUs shared among the
    actors. ``object_store_mb``: the local Ray's object store (default Ray's)."""

    address: str | None = None
    actors: int | None = None
    gpus_per_actor: float | None = None
    object_store_mb: int | None = None


@dataclass
class PartCall:
    """One part for an encoder actor: its ``name``, input range and ``digest`` (what the
    manifest records), ``planned``: its inputs by index in input order (a header's error
    travels with its entry), ``batches``: the indices per batch, as the local run packs them."""

    name: str
    start: int
    end: int
    digest: str
    planned: dict[int, Planned]
    batches: list[list[int]]


# ----------------------------------------------------------------------------- the actor

class SegmentEncoder:
    """An encoder actor: the weights loaded and the decode pool started once, then called
    once per part (``encode_part``). ``device_type``: what Ray gave it (``cuda`` with a GPU);
    ``dtype``: the compute dtype (``auto`` resolves on the actor's own device)."""

    def __init__(self, opts: EncodeOptions, device_type: str, dtype: str) -> None:
        self.failed: DsvError | None = None
        try:
            self._start(opts, device_type, dtype)
        except DsvError as exc:  # (weights, device): ``describe`` raises it, the run's line
            self.failed = exc  # (raised here, Ray says that the actor died, and restarts it)

    def _start(self, opts: EncodeOptions, device_type: str, dtype: str) -> None:
        from ..engine.device import resolve_device, resolve_dtype
        from ..process import own_process_pillow_settings, own_process_settings
        from .pipeline import Computing, decode_pool, load_model, tower_engine

        own_process_pillow_settings()
        device = resolve_device(device_type)
        own_process_settings(device)
        compute = resolve_dtype(dtype, device)
        ckpt = load_model(opts, compute)
        self.opts, self.engine = opts, tower_engine(ckpt, device, opts)
        self.computing = Computing.of(ckpt, compute, self.engine)
        self.pool = decode_pool(opts, ckpt.config, device, opts.workers)  # ``actor_workers``

    def describe(self, probe: tuple[str, bytes] | None = None) -> tuple[Any, bool, str]:
        """What this actor computes with (``pipeline.Computing``: the driver checks that every
        actor agrees), whether it sees a local ``--out`` as the driver does (``probe``: a file
        of the driver's there and its content; the actor writes its parts beside it), and
        its host's name. Raises what its set-up raised (weights, device), as the local run does."""
        if self.failed is not None:
            raise self.failed
        try:
            sees = probe is None or Path(probe[0]).read_bytes() == probe[1]
        except OSError:
            sees = False
        return self.computing, sees, socket.gethostname()

    def encode_part(self, call: PartCall, schema, folder: str,
                    drop_cache: bool) -> tuple[dict, RunSummary, list[int]]:
        """Encode one part (``PartEncoder``) and write its file into ``folder`` (a local one, under
        a temporary name the driver renames, or a bucket's URL; ``drop_cache``: never read
        back). Returns the manifest entry, the part's summary and its progress
        (``progress.RunProgress.advance``'s arguments), never the rows."""
        from ..output.parts import kept_columns, rows_per_group, rows_to_table, write_part
        from .encoding import PartEncoder

        planned = call.planned
        pause("segment", pid=os.getpid(), images=list(planned))
        stream = self.pool.imap(((i, planned[i].item) for batch in call.batches for i in batch),
                                window=decode_window(self.pool.n_workers,
                                                    self.opts.engine.max_images))
        summary, progress = RunSummary(out=""), _Tally()
        encoder = PartEncoder(self.engine, self.opts, Topology(), progress, summary,
                              StopSignals(immediate=False))
        part = Part(call.name, call.start, call.end, list(planned), call.digest)
        began = time.perf_counter()
        try:
            ((*_, rows),) = encoder.run(planned, [(part, [call.batches])], stream)
        finally:
            stream.close()  # a DecodeStream, or a generator without decode workers
        summary.model_s = time.perf_counter() - began - summary.decode_wait_s
        items = [entry.item for entry in planned.values()]
        table = rows_to_table(rows, schema, kept_columns(schema, items))
        group_rows = rows_per_group(schema, rows)
        del rows  # the table holds what it needs of them
        entry = write_part(folder, call.name, table, group_rows, call.start, call.end,
                           call.digest, drop_cache=drop_cache, staged=True)
        pause("written", pid=os.getpid(), name=call.name)
        return entry, summary, progress.counts


class _Tally:
    """An actor's progress: ``PartEncoder``'s counts summed, for the driver's display."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0, 0]

    def advance(self, images: int, tokens: int, failed: int, dropped_tokens: int = 0) -> None:
        added = (images, tokens, failed, dropped_tokens)
        self.counts = [a + b for a, b in zip(self.counts, added)]


# ----------------------------------------------------------------------------- the cluster

class RayCluster:
    """The Ray the run uses: the one at ``address`` (joined, and left at the end), or a
    local one started for the run (and shut down at the end)."""

    def __init__(self, ray_opts: RayEngineOptions, stop: StopSignals) -> None:
        try:
            import ray  # there: ``run_ray_encode`` checked
        except Exception as exc:  # there, but broken: a missing library, a version clash
            raise UsageError(f"--engine ray needs Ray, which fails to import here "
                             f"({type(exc).__name__}: {exc})") from None

        self.ray = ray
        # Ray's own log lines (its token notice, ...) are no louder than dsv4enc's: none but
        # errors under -q. (Importing ray set up its logger: the level is set after it.)
        ray_log = logging.getLogger("ray")
        self.ray_log_level = ray_log.level
        ray_log.setLevel(max(ray_log.getEffectiveLevel(), log.getEffectiveLevel()))
        self.address = ray_opts.address or os.environ.get("RAY_ADDRESS") or None
        self.joined = self.started = False
        self.quiet = log.getEffectiveLevel() > logging.WARNING
        if ray.is_initialized():  # an in-process caller's own Ray: used, left as it is
            self.worker_logs = _driver_messages(ray, not self.quiet)
            return
        env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
        where = f"the Ray cluster at {self.address}" if self.address else "a local Ray"
        if self.address:
            probe_address(self.address, where)
            joining: dict[str, Any] = {"address": self.address}
        else:  # address="local": a new Ray even where an earlier one left its address file
            # in Ray's temp folder (a bare ray.init() would try to join that one)
            store = ray_opts.object_store_mb << 20 if ray_opts.object_store_mb else None
            joining = dict(address="local", num_cpus=available_cpus(),
                           object_store_memory=store, include_dashboard=False)
        with suppress(ValueError):  # (not the main thread: the run installed no handlers)
            for signum in (signal.SIGINT, signal.SIGTERM):
                if callable(handler := signal.getsignal(signum)):
                    signal.signal(signum, _halting(handler))
        try:
            with warnings.catch_warnings():
                if self.quiet:  # -q: Ray's warnings too
                    warnings.simplefilter("ignore")
                ray.init(**joining, log_to_driver=False, logging_level=logging.WARNING,
                         configure_logging=False, runtime_env={"env_vars": env} if env else None)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise DsvError(f"cannot start or join {where}: {' '.join(str(exc).split())}") from None
        except SystemExit as exc:  # a signal: the run's (``_halting``), or ray.init's SIGTERM
            if exc.code not in (signal.SIGINT, signal.SIGTERM):  # handler until it returned
                raise
            raise Interrupted(exc.code, stop.hint) from None
        finally:
            stop.reinstall()  # ray.init put its SIGTERM handler in place of the run's
        self.joined, self.started = True, not self.address
        self.worker_logs = _driver_messages(ray, not self.quiet)

    def resources(self) -> tuple[float, float, int, float]:
        """(CPUs, GPUs, alive nodes with CPUs, the fewest CPUs of such a node)."""
        ray = self.ray
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU")]
        node_cpus = min((n["Resources"]["CPU"] for n in nodes), default=total.get("CPU", 1))
        return total.get("CPU", 1.0), total.get("GPU", 0.0), max(1, len(nodes)), node_cpus

    def close(self) -> None:
        if self.joined:
            self.ray.shutdown()  # a local Ray stops; a remote cluster is only left
            self.joined = False
        _driver_messages(self.ray, self.worker_logs)
        logging.getLogger("ray").setLevel(self.ray_log_level)


def _halting(handler):
    """The run's signal ``handler``, its ``Interrupted`` raised as a ``SystemExit``: where
    ``ray.init`` starts a local Ray it catches any Exception, logs it and goes on starting
    (a second line, and seconds more), but lets a SystemExit end it."""

    def halt(signum, frame) -> None:
        try:
            handler(signum, frame)
        except Interrupted:
            raise SystemExit(signum) from None

    return halt


def _driver_messages(ray, shown: bool) -> bool:
    """Whether the driver prints what Ray tells it (a worker died, a task is retried: Ray's
    error messages, which it prints on stdout whatever ``log_to_driver`` says), set to
    ``shown``; returns the earlier setting. Under -q they are not printed: stdout holds
    only the output's path. (Ray's one switch for them, which its debugger uses too.)"""
    module = getattr(getattr(ray, "_private", None), "worker", None)  # absent: left as it is
    earlier = getattr(module, "_worker_logs_enabled", True)
    if hasattr(module, "_worker_logs_enabled"):
        module._worker_logs_enabled = shown
    return earlier


def probe_address(address: str, where: str) -> None:
    """A ``DsvError`` unless ``address`` (``host:port``, a ``ray://`` one too) accepts a TCP
    connection within ``JOIN_PROBE_S``. An address in another form is left to ``ray.init``."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=JOIN_PROBE_S).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise DsvError(f"cannot join {where}: nothing answers there ({why}); is its head "
                       "node up, and is this its GCS address (host:port)?") from None


@dataclass
class ActorPlan:
    """How many encoder actors, and what each holds. ``short``: what the actors need beyond
    what the cluster has now (``"3 CPUs (1 each), and the cluster has 2"``), else empty."""

    actors: int
    cpus: float
    gpus: float
    device_type: str
    short: str = ""


def plan_actors(opts: EncodeOptions, ray_opts: RayEngineOptions, cluster: RayCluster) -> ActorPlan:
    """The actor pool for ``--device`` on this cluster (``RayEngineOptions``' defaults)."""
    cpus, gpus, nodes, node_cpus = cluster.resources()
    if opts.device.partition(":")[0] not in ("auto", "cpu", "cuda"):  # (the local run's line)
        raise UsageError(f"unknown device {opts.device!r} (use auto, cpu, cuda or cuda:N)")
    if opts.device.startswith("cuda") and not gpus and not ray_opts.gpus_per_actor:
        raise UsageError(f"--device {opts.device}: the Ray cluster has no GPUs")
    per_gpu = ray_opts.gpus_per_actor
    if per_gpu is None:
        per_gpu = 1.0 if opts.device != "cpu" and gpus >= 1 else 0.0
    if not 0 <= per_gpu < float("inf"):  # NaN too
        raise UsageError(f"--ray-gpus-per-actor must be 0 or more, and finite, not {per_gpu:g}")
    if per_gpu and opts.device == "cpu":
        raise UsageError("--device cpu with --ray-gpus-per-actor: choose one")
    if not per_gpu and opts.device.startswith("cuda"):  # an actor given no GPU sees none
        raise UsageError(f"--device {opts.device} with --ray-gpus-per-actor 0: choose one")
    actors = ray_opts.actors
    if actors is None:
        actors = max(1, int(gpus // per_gpu)) if per_gpu else nodes
    if actors < 1:
        raise UsageError("--ray-actors must be at least 1")
    per_cpu = min(max(1.0, float(int(cpus // actors))), node_cpus)
    plan = ActorPlan(actors, per_cpu, per_gpu, "cuda" if per_gpu else "cpu")
    fewer = "--ray-actors"  # (one actor's GPUs are fewer only by their own option)
    for kind, each, has in (("CPU", per_cpu, cpus), ("GPU", per_gpu, gpus)):
        if actors * each > has:
            plan.short = f"{actors * each:g} {kind}s ({each:g} each), and the cluster has {has:g}"
            if kind == "GPU":
                fewer = f"{fewer + ' or ' if actors > 1 else ''}--ray-gpus-per-actor"
            break
    if plan.short and cluster.started:  # no autoscaler adds to a Ray the run started
        raise UsageError(f"{actors} encoder actor{'s need' if actors > 1 else ' needs'} "
                         f"{plan.short} (a local Ray started for the run, which never "
                         f"grows): ask for fewer with {fewer}")
    return plan


def actor_workers(opts: EncodeOptions, plan: ActorPlan) -> int:
    """Decode processes per actor: ``--workers``, else ``default_workers``'s rule for a machine
    of the actor's CPUs, so that the actors of one node share its cores."""
    if opts.workers is not None:
        return opts.workers
    return default_workers(plan.device_type, cpus=max(1, int(plan.cpus)))


# ----------------------------------------------------------------------------- the driver

def run_ray_encode(opts: EncodeOptions, ray_opts: RayEngineOptions, stop: StopSignals):
    """Encode ``opts.inputs`` into ``opts.out`` on Ray encoder actors: ``run_encode``'s run
    with ``RayParts`` behind it (its summary, its errors). ``stop``: the caller's signal
    handling, installed."""
    from .pipeline import run_encode

    validate(opts)
    if launched_ranks() > 1:
        raise UsageError("--engine ray runs from one process: launch it without torchrun")
    if opts.shard_output or opts.tp_mode != "data":
        raise UsageError("--shard-output and --tp-mode are torchrun options; --engine ray "
                         "writes one output from its driver")
    if opts.update:
        raise UsageError("--update runs on the local engine: drop --engine ray for it")
    if importlib.util.find_spec("ray") is None:
        raise UsageError("--engine ray needs Ray: pip install 'dsv4enc[ray]'")
    return run_encode(opts, stop=stop, source=RayParts(ray_opts, stop))


class RayParts:
    """The Ray engine behind the run skeleton (``pipeline.PartSource``): encoder actors
    that each encode and write whole parts. Ray is started (or joined) only once the inputs
    and ``--out`` passed their checks (``prepare``), so that a refused run says so at once;
    the whole plan is made before the first call (``cut``: every header)."""

    written_elsewhere = True

    def __init__(self, ray_opts: RayEngineOptions, stop: StopSignals) -> None:
        self.ray_opts, self.stop = ray_opts, stop
        self.cluster: RayCluster | None = None
        self.actors: list = []

    # -- set-up ---------------------------------------------------------------------
    def prepare(self, opts: EncodeOptions, layout, ranks, remote) -> str | None:
        """Ray joined and the actor pool planned; ``--dtype``, or under ``--resume`` with
        ``auto`` the interrupted run's on the same device kind (and the line that says so)."""
        self.opts, self.layout, self.remote = opts, layout, remote
        self.cluster = RayCluster(self.ray_opts, self.stop)
        self.plan = plan_actors(opts, self.ray_opts, self.cluster)
        recorded = layout.interrupted_settings() if opts.resume else None
        self.dtype = opts.dtype
        if (recorded and opts.dtype == "auto" and recorded.get("device") == self.plan.device_type
                and recorded.get("compute_dtype")):
            self.dtype = recorded["compute_dtype"]
            return f"--resume: computing in {self.dtype}, as the interrupted run did"
        return None

    def start(self, setup, progress):
        plan = self.plan
        starting = f"starting {plan.actors} encoder actor{'s' if plan.actors > 1 else ''} on Ray"
        if plan.short:  # a joined cluster: its autoscaler may add what is missing
            starting += f" (waiting: they need {plan.short})"
            progress.announce(starting)
        progress.status(starting)
        remote = self.cluster.ray.remote(SegmentEncoder).options(
            num_cpus=plan.cpus, num_gpus=plan.gpus, max_restarts=MAX_RESTARTS,
            max_task_retries=MAX_TASK_RETRIES)
        opts = replace(self.opts, workers=actor_workers(self.opts, plan))
        self.actors = [remote.remote(opts, plan.device_type, self.dtype)
                       for _ in range(plan.actors)]
        # every actor's settings once it is up (weights loaded): they must agree, and each
        # must see a local --out (it writes its parts there)
        layout, probe = self.layout, None
        if self.remote is None and layout.lock.held:
            probe = (str(layout.lock.path.resolve()), layout.lock.path.read_bytes())
        described = self._get(self._ready([a.describe.remote(probe) for a in self.actors]))
        blind = next((host for _, sees, host in described if not sees), None)
        if blind is not None:
            raise UsageError(f"--engine ray: the encoder actors write their parts into --out, "
                             f"and --out {self.opts.out} is not this folder on node {blind}; "
                             "give --out a folder every node shares, or a bucket")
        settings = [computing for computing, _, _ in described]
        if any(other != settings[0] for other in settings[1:]):
            raise DsvError("the encoder actors disagree on their settings (device, dtype "
                           "or weights): give every node the same weights and devices")
        self.described = settings[0]
        return self.described

    def cut(self, setup, part_images: int, progress, stop) -> list:
        """Every header at once, the single file's size checked, and every segment."""
        opts, described = self.opts, self.described
        cfg = described.config
        setup.headers(cfg, opts, stop.requested, announce=progress.status)
        if stop.signum is not None:
            raise Interrupted(stop.signum, "nothing was encoded; rerun the same command")
        self.layout.check_file_size(output_bytes(cfg, opts, setup.planned))
        return setup.cut_parts(part_images,
                               segment_tokens(described.engine.batch_tokens, described.device))

    def opening_line(self, inputs: int) -> str:
        from .pipeline import inputs_phrase, model_and_output

        plan, described = self.plan, self.described
        each = (f"{plan.gpus:g} GPU" if plan.gpus else f"{plan.cpus:g} CPU") + " each"
        return (f"encoding {inputs_phrase(inputs)} on {plan.actors} Ray "
                f"actor{'s' if plan.actors != 1 else ''} ({each}, {described.device}) in "
                f"{described.compute_dtype}; {model_and_output(self.opts, described.config)}")

    def planned_tokens(self, setup, todo) -> int:
        return sum(setup.planned[i].tokens for p in todo for i in range(p.start, p.end))

    def _ready(self, refs: list) -> list:
        """``refs`` once all are done, waited for ``POLL_S`` at a time so that a signal ends
        the wait (an actor that no node can hold yet waits for as long as it takes)."""
        ray, pending = self.cluster.ray, list(refs)
        with self.stop.deferred():
            while pending and not self.stop.requested():
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        self.stop.check()
        return refs

    def _get(self, refs):
        """``ray.get``, a failed actor call turned into the run's own error."""
        ray = self.cluster.ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, (DsvError, Interrupted)):
                raise cause from None
            raise DsvError(f"an encoder actor failed: {_last_line(cause or exc)}") from None
        except ray.exceptions.RayActorError as exc:
            raise DsvError(f"an encoder actor died {MAX_RESTARTS + 1} times "
                           f"({_last_line(exc)}); finished parts are kept: rerun with "
                           "--resume") from None

    # -- the run ----------------------------------------------------------------------
    def encode(self, setup, output, writer, run, begin) -> None:
        """Send the parts to the actors, ``IN_FLIGHT_PER_ACTOR`` each, and commit the files
        they wrote in input order. By hand on ``ray.wait``: Ray's ActorPool allows one call in
        flight per actor, and an actor should have its next part queued while it encodes one."""
        ray, stop = self.cluster.ray, run.stop
        calls = part_calls(setup.planned, output.todo,
                           output.engine.batch_tokens, output.engine.max_images,
                           CALLS_PER_ACTOR * len(self.actors))
        if self.remote is not None:  # once the manifests that --overwrite replaces are gone
            self.remote.drop_replaced()
            folder, drop_cache = self.remote.parts_url, False
        else:
            folder, drop_cache = str(self.layout.parts_dir.resolve()), self.layout.folder_mode
        in_flight: dict[Any, tuple[int, int]] = {}  # ref -> (call, actor)
        reports: dict[int, tuple] = {}
        window, sent, done = IN_FLIGHT_PER_ACTOR * len(self.actors), 0, 0
        if calls:
            begin()  # which sets the status to "encoding" too
        try:
            with stop.deferred():
                while done < len(calls) and not stop.requested():
                    while sent < len(calls) and sent - done < window:
                        busy = [a for _, a in in_flight.values()]
                        actor = min(range(len(self.actors)), key=busy.count)  # the least busy
                        ref = self.actors[actor].encode_part.remote(
                            _with_held(calls[sent]), output.schema, folder, drop_cache)
                        in_flight[ref] = (sent, actor)
                        sent += 1
                    ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
                    for ref in ready:
                        reports[in_flight.pop(ref)[0]] = self._get(ref)
                    while done in reports:
                        _commit(calls[done], reports.pop(done), writer, run)
                        done += 1
        finally:
            for ref in in_flight:  # stopped early: the actors are killed next anyway
                with suppress(Exception):
                    ray.cancel(ref)

    def finish(self, summary, ranks) -> None:
        pass  # the actors' counts were added part by part

    def close(self) -> None:
        for actor in self.actors:  # (only once Ray was joined: actors need it)
            with suppress(Exception):  # already gone
                self.cluster.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.cluster is not None:
            self.cluster.close()


def _commit(call: PartCall, report: tuple, writer, run) -> None:
    """A part an actor wrote (``SegmentEncoder.encode_part``'s report): its entry to the writer
    (which commits it), its counts to the summary and the progress."""
    entry, done, progress = report
    run.summary.add(done)
    run.summary.count_misnamed(list(call.planned.values()))  # the driver read every header
    writer.put_written(call.name, entry)
    run.progress.advance(*progress)


def part_calls(planned, todo, batch_tokens: int, max_images: int | None,
               wanted: int) -> list[PartCall]:
    """The calls that encode the segments ``todo``: the consecutive segments of one part go
    in one call, whose file is one part (named after its first segment, as the local run
    joins segments), and parts are cut at segment bounds into about ``wanted`` calls when
    there are fewer, so that every actor has work."""
    runs: list[list] = []
    for segment in todo:
        if (runs and runs[-1][-1].end == segment.start
                and runs[-1][-1].part_end == segment.part_end):
            runs[-1].append(segment)
        else:
            runs.append([segment])
    pieces = max(1, -(-wanted // max(1, len(runs))))
    calls = []
    for run in runs:
        step = max(1, -(-len(run) // pieces))
        for k in range(0, len(run), step):
            group = run[k:k + step]
            start, end = group[0].start, group[-1].end
            indices = [i for segment in group for i in segment.indices]
            digest = group[0].digest if len(group) == 1 else inputs_digest(planned[start:end])
            calls.append(PartCall(group[0].name, start, end, digest,
                                  {i: planned[i] for i in indices},
                                  part_batches(planned, indices, batch_tokens, max_images)))
    return calls


def _with_held(call: PartCall) -> PartCall:
    """``call`` as it is sent: an item read ahead by its header probe goes with its bytes."""
    return replace(call, planned={i: replace(p, item=attach_held(p.item))
                                  for i, p in call.planned.items()})


def _last_line(exc: BaseException) -> str:
    """The last line of ``exc``'s text: a Ray error's traceback ends in its message."""
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
