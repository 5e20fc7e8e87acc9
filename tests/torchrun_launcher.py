"""Test-only entry point for torchrun launches of the real CLI (tests/test_run_torchrun.py).

Each launch of torchrun costs seconds on a small machine, so some tests run several
``dsv4enc encode`` command lines in one launch, and the failure tests need a rank that dies
on purpose, which product code must not know how to do. Both are done here, from outside,
by wrapping the pipeline.

  torchrun ... torchrun_launcher.py die MARKER ENCODE-ARGS...
      ``dsv4enc encode ENCODE-ARGS``, but rank 1 calls os._exit(1) right after its first
      batch (before the next one starts), having written the time (time.time()) to MARKER.
  torchrun ... torchrun_launcher.py sequence RUNS.json RESULTS_DIR
      RUNS.json: a list of argument lists for ``dsv4enc``, run one after another in this
      process (each joins and leaves the process group; the second and later ones under
      a store prefix of their own, as a fresh launch would be). An argument list that starts with
      "@interrupt" gets SIGINT on rank 0 as soon as its first part is handed to the writer;
      ["@rm", PATH] is no run: rank 0 deletes PATH (code 0, or 1 if it was not there);
      ["@rank1", ARG, ...]: rank 1 alone appends ARG to the rest (ranks given different
      options or inputs).
      Each rank writes RESULTS_DIR/rank{R}.json: [{"argv", "code", "stderr"}, ...].
  torchrun ... torchrun_launcher.py pid MARKER ENCODE-ARGS...
      ``dsv4enc encode ENCODE-ARGS``, each rank having written its process id to
      MARKER.rank{R}.pid (so that a test can kill one rank at a pause point).
  torchrun ... torchrun_launcher.py held MARKER ENCODE-ARGS...
      ``dsv4enc encode ENCODE-ARGS`` through ``cli.main``, each rank having written its
      process id to MARKER.rank{R}.pid; only rank 1 keeps the test's pause points, and
      rank 0 touches MARKER.rank0.waiting when it enters an all-gather after its first
      progress step: with rank 1 held at the ``encoded`` pause point (the same step), that
      collective waits for rank 1 as long as it is held.
  torchrun ... torchrun_launcher.py timed MARKER ENCODE-ARGS...
      ``dsv4enc encode ENCODE-ARGS`` through the console script's entry point
      (``cli.main``), each rank having written MARKER.rank{R}.json: {"launched": the time
      this module started, "run_encode": the time the pipeline was called} (time.time()).
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # before the imports below (torch among them)

import datetime
import io
import json
import logging
import os
import signal
import sys
from contextlib import redirect_stderr
from pathlib import Path

import torch.distributed as dist

from dsv4enc import cli
from dsv4enc.run.encoding import PartEncoder


class _CurrentStderr(logging.StreamHandler):
    """A log handler that writes to whatever sys.stderr is now (captured per run)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def die_after_first_batch(marker: str) -> None:
    original = PartEncoder.submit_batch
    calls = {"n": 0}

    def submit_batch(self, *args, **kwargs):
        if self.ranks.rank == 1 and calls["n"] == 1:
            Path(marker).write_text(repr(time.time()))
            sys.stderr.flush()
            os._exit(1)
        calls["n"] += 1
        return original(self, *args, **kwargs)

    PartEncoder.submit_batch = submit_batch


def interrupt_after_first_part(enabled: dict) -> None:
    original = PartEncoder.run

    def run(self, *args, **kwargs):
        for index, part in enumerate(original(self, *args, **kwargs)):
            yield part
            if index == 0 and enabled["on"] and self.ranks.is_main:
                os.kill(os.getpid(), signal.SIGINT)

    PartEncoder.run = run


def fresh_store_per_run() -> None:
    """Later process groups in this process rendezvous under their own key prefix: torchrun's
    store still holds the first group's keys (e.g. peer addresses that are closed now)."""
    original = dist.init_process_group
    count = {"n": 0}

    def init_process_group(*args, **kwargs):
        count["n"] += 1
        if count["n"] > 1 and "store" not in kwargs and "init_method" not in kwargs:
            timeout = kwargs.get("timeout") or datetime.timedelta(seconds=60)
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=timeout)
            kwargs["store"] = dist.PrefixStore(f"dsv4enc-test-run{count['n']}", base)
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group


def hold_rank1(marker: str) -> None:
    from dsv4enc.pausepoints import POINTS_VARIABLE
    from dsv4enc.run.dist import DistContext
    from dsv4enc.run.progress import RunProgress

    rank = int(os.environ.get("RANK", "0"))
    Path(f"{marker}.rank{rank}.pid").write_text(str(os.getpid()))
    if rank != 0:
        return
    os.environ.pop(POINTS_VARIABLE, None)
    advanced = {"yes": False}
    original_advance, original_gather = RunProgress.advance, DistContext.all_gather

    def advance(self, *args, **kwargs):
        original_advance(self, *args, **kwargs)
        advanced["yes"] = True

    def all_gather(self, *args, **kwargs):
        if advanced["yes"]:
            Path(f"{marker}.rank0.waiting").touch()
        return original_gather(self, *args, **kwargs)

    RunProgress.advance, DistContext.all_gather = advance, all_gather


def record_run_start(marker: str) -> None:
    from dsv4enc.run import pipeline

    original = pipeline.run_encode

    def run_encode(*args, **kwargs):
        called = time.time()
        Path(f"{marker}.rank{os.environ.get('RANK', '0')}.json").write_text(
            json.dumps({"launched": LAUNCHED, "run_encode": called}))
        return original(*args, **kwargs)

    pipeline.run_encode = run_encode


def run_cli(argv: list[str]) -> int:
    try:
        cli.app(args=argv, prog_name="dsv4enc")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def sequence(runs_file: str, results_dir: str) -> None:
    logging.getLogger().addHandler(_CurrentStderr())
    interrupt = {"on": False}
    interrupt_after_first_part(interrupt)
    fresh_store_per_run()
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for argv in json.loads(Path(runs_file).read_text()):
        if argv and argv[0] == "@rm":
            # rank 0 only: the other ranks' next run waits for rank 0's output checks
            existed = rank != 0 or Path(argv[1]).is_file()
            if rank == 0 and existed:
                Path(argv[1]).unlink()
            results.append({"argv": argv, "code": 0 if existed else 1, "stderr": ""})
            continue
        if argv and argv[0] == "@rank1":
            argv = argv[2:] + ([argv[1]] if rank == 1 else [])
        interrupt["on"] = bool(argv) and argv[0] == "@interrupt"
        argv = argv[1:] if interrupt["on"] else argv
        captured = io.StringIO()
        with redirect_stderr(captured):
            code = run_cli(argv)
        results.append({"argv": argv, "code": code, "stderr": captured.getvalue()})
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "die":
        die_after_first_batch(rest[0])
        sys.exit(run_cli(["encode", *rest[1:]]))
    if mode == "pid":
        Path(f"{rest[0]}.rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
        sys.exit(run_cli(["encode", *rest[1:]]))
    if mode == "held":  # through cli.main, which owns the process: a hung stop ends it
        hold_rank1(rest[0])
        sys.argv = ["dsv4enc", "encode", *rest[1:]]
        cli.main()  # ends the process
    if mode == "sequence":
        sequence(*rest)
        return
    if mode == "timed":
        record_run_start(rest[0])
        sys.argv = ["dsv4enc", "encode", *rest[1:]]
        cli.main()  # ends the process
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
