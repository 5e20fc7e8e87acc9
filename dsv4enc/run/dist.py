"""Running on many ranks: the process group and row gathering. ``torch.distributed`` is
touched here only, through a ``DistContext``, whose collectives ``run/ranks.Topology`` calls.
Launch with torchrun; a plain launch has no context (``init_distributed`` returns None).

Failures: a collective that times out, or whose peer died, raises ``DistributedError``
naming this rank. Host-facing collectives (gather, object gather, barrier, and gloo's
all-reduce) wait on the host with the run's timeout, on NCCL too; on gloo in slices, so that
a signal's handler runs while a peer keeps the collective. The tensor-parallel all-reduce
inside the forward on NCCL does not: there it stays stream-ordered (a host wait per layer
would stall the GPU and break CUDA graph capture), so a hang there is caught by NCCL's
watchdog, which aborts the process after the same timeout and lets torchrun stop the others."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError, UsageError

log = logging.getLogger(__name__)

#: The longest timeout a collective is given (31 years): c10d adds it to its clock's time
#: in nanoseconds, which a longer one (``--timeout inf``) overflows, ending the wait at once.
LONGEST_WAIT_S = 1e9

# Newer torch calls it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: A host wait on gloo is this long at most before it returns to Python (and the wait goes
#: on): a signal's handler runs that soon however long a peer keeps the collective, while a
#: collective that completes ends its wait at once (benchmarks/RESULTS.md).
WAIT_SLICE_S = 0.25
#: How gloo says that a wait's time ran out (the collective itself goes on).
_GLOO_TIMED_OUT = "Operation timed out"


@dataclass
class DistContext:
    """This process's place in a torchrun job, and the collectives the encoder needs."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "nccl" or "gloo"
    timeout: float  # seconds, for every collective

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _failed(self, what: str, exc: BaseException | None = None) -> DistributedError:
        """The line for a collective (``what``) that timed out or broke: it names the rank
        that stopped answering (the other one of two; of more, the backend does not say
        which) and where its reason is; not ``what``, an internal name the user never gave
        (the backend's own words stay in the error's cause)."""
        peer = f"rank {1 - self.rank}" if self.world_size == 2 else "a peer rank"
        look = "see its own lines above, or torchrun's report of its exit, for why"
        if exc is None or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return DistributedError(
                f"rank {self.rank}: {peer} stopped answering: no reply from it, timed out "
                f"after {self.timeout:g}s (--timeout); the peer rank may have died or be "
                f"stuck: {look}")
        # First sentence, without gloo's "[file.cc:line]" prefix.
        first = re.sub(r"^\[[^\]]*\]\s*", "", _first_line(exc)).split(". ")[0]
        return DistributedError(
            f"rank {self.rank}: {peer} stopped answering: its connection broke "
            f"({first[:200] or type(exc).__name__}); the peer rank may have died: {look}")

    def _wait(self, what: str, start: Callable[[], Any]) -> None:
        """Run an async collective and wait for it on the host, at most ``timeout``: on NCCL
        in one wait, on gloo in slices of ``WAIT_SLICE_S``. Python's signal handlers run only
        between bytecodes of the main thread, so a stop (``run/stopping``) must not sit
        behind a peer that never answers until the whole timeout is gone."""
        try:
            work = start()
            if self.backend == "nccl":
                work.wait(datetime.timedelta(seconds=self.timeout))
                return
            deadline = time.monotonic() + self.timeout
            while not self._waited(work, deadline - time.monotonic()):
                if time.monotonic() >= deadline:
                    raise self._failed(what)
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            raise self._failed(what, exc) from exc

    @staticmethod
    def _waited(work, left: float) -> bool:
        """Wait on gloo's ``work`` for one slice (at most ``left`` s): whether it completed."""
        try:
            work.wait(datetime.timedelta(seconds=max(min(WAIT_SLICE_S, left), 0.001)))
        except RuntimeError as exc:
            if _GLOO_TIMED_OUT not in str(exc):
                raise
            return False
        return True

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Same-shape tensors from every rank: (n, ...) -> (world_size, n, ...), rank order.
        Moved as raw bytes, so any dtype works on any backend (bf16 and fp16 included)."""
        local = tensor.to(self.device).contiguous()
        flat = local.reshape(1, -1).view(torch.uint8)  # (1, numel * itemsize)
        out = torch.empty(self.world_size, flat.shape[1], dtype=torch.uint8, device=self.device)
        self._wait("all_gather", lambda: _all_gather_single(out, flat, async_op=True))
        return out.view(tensor.dtype).view(self.world_size, *tensor.shape)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """One picklable object from every rank, in rank order (pickled through all_gather,
        so that it shares the host-side timeout; torch's own version blocks without one)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        parts = gather_rows(self, payload.view(-1, 1))  # the sizes exchanged first
        return [pickle.loads(p.cpu().numpy().tobytes()) for p in parts]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (the tensor-parallel combine);
        fine under ``torch.inference_mode``. On NCCL: no host wait (the module docstring)."""
        if self.backend != "nccl":  # gloo: a host wait, which a signal's handler interrupts
            self._wait("all_reduce", lambda: dist.all_reduce(tensor, async_op=True))
            return tensor
        try:
            dist.all_reduce(tensor)
        except RuntimeError as exc:
            raise self._failed("all_reduce", exc) from exc
        return tensor

    def barrier(self) -> None:
        """Wait until every rank gets here (or raise DistributedError after ``timeout``)."""
        self._wait("barrier", lambda: dist.barrier(async_op=True))


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None and default is None:
        raise UsageError(f"{name} is not set (launch with torchrun)")
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from None


def init_distributed(device_arg: str, timeout_s: float) -> DistContext | None:
    """Join the torchrun job described by the environment; None when WORLD_SIZE is unset
    or 1 (a single rank needs no process group). ``device_arg``: "auto", "cuda" or "cpu":
    every rank on CUDA uses cuda:LOCAL_RANK with NCCL (an explicit "cuda:N" is a
    UsageError); on CPU, gloo."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return None
    timeout_s = min(timeout_s, LONGEST_WAIT_S)  # --timeout inf: a wait without end
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if device_arg not in ("auto", "cuda", "cpu"):
        raise UsageError(f"under torchrun, --device must be auto, cuda or cpu (each rank "
                         f"uses cuda:LOCAL_RANK), not {device_arg!r}")
    if device_arg == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but CUDA is not available")
    if device_arg != "cpu" and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"rank {rank}: LOCAL_RANK {local_rank} but only "
                             f"{torch.cuda.device_count()} CUDA device(s) on this node")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                rank=rank, world_size=world_size,
                                device_id=device if backend == "nccl" else None)
    except (RuntimeError, ValueError) as exc:  # rendezvous timeout, unreachable store
        raise DistributedError(f"rank {rank}: could not join the process group "
                               f"({_first_line(exc)})") from exc
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend,
                       float(timeout_s))


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s text, or its type's name when it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def shutdown(ctx: DistContext | None) -> None:
    """Leave the process group (no-op without one). Never raises: it runs on error paths."""
    if ctx is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a broken group can fail to tear down; nothing left to do
        log.debug("rank %d: destroy_process_group failed: %s", ctx.rank, exc)


def gather_rows(ctx: DistContext, local_rows: torch.Tensor,
                counts_per_rank: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Every rank's output rows, on every rank, with ONE all-gather (padded to the largest
    count, cut back after). local_rows: (n_local, width), this rank's rows in assignment order.
    counts_per_rank: every rank's n_local, from the shared plan (None: exchanged first, one
    more small collective). Returns ``world_size`` tensors (counts_per_rank[r], width) in the
    dtype and on the device of ``local_rows`` (nothing is sent when every rank has zero)."""
    n_local, width = local_rows.shape
    if counts_per_rank is None:
        counts_per_rank = ctx.all_gather(torch.tensor([n_local], dtype=torch.int64)).view(-1)
    counts = [int(n) for n in counts_per_rank]
    if len(counts) != ctx.world_size or counts[ctx.rank] != n_local:
        # A plan mismatch would silently misplace rows on every rank; fail loudly here.
        raise DistributedError(f"rank {ctx.rank}: holds {n_local} rows, but the plan says "
                               f"{counts[ctx.rank] if ctx.rank < len(counts) else '?'} "
                               f"(counts {counts}, world size {ctx.world_size})")
    most = max(counts)
    if most == 0:  # every rank knows this, so every rank skips the collective together
        return [local_rows.new_empty((0, width)) for _ in counts]
    padded = torch.zeros(most, width, dtype=local_rows.dtype, device=ctx.device)
    padded[:n_local] = local_rows
    everyone = ctx.all_gather(padded).to(local_rows.device)  # (world, most, width)
    return [everyone[r, :n] for r, n in enumerate(counts)]
