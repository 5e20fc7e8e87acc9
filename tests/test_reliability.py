"""Crash safety and resume: runs killed by SIGKILL, stopped by SIGTERM or SIGINT, then
finished with ``--resume``, compared row by row with a clean run; and the refusals that keep
a resumed run from mixing outputs of different settings.

The interrupted runs are real ``python -m dsv4enc encode`` processes over ~90 small images
with 3-image parts (the hidden ``--part-images``), signalled as soon as their first part is
committed to the ``.partial`` folder's manifest. The three start together to share their
start-up time. Everything else runs in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from dsv4enc.images import headers
from dsv4enc.output.files import GROWING_NAME
from dsv4enc.cli import app
from dsv4enc.images.decode import Probe
from dsv4enc.run.pipeline import EncodeOptions, Interrupted, run_encode
from dsv4enc.output.read import load_manifest

from helpers import CONFIGS, REPO_ROOT, Pauses, parts_of, torch_threads

CONFIG = str(CONFIGS / "tiny.json")
N_GOOD = 88
PART = 3
BROKEN = {"img030b.png": b"", "img061b.jpg": b"not an image at all"}
COMMON = ["--config", CONFIG, "--random-init", "--device", "cpu", "--part-images", str(PART),
          "--batch-tokens", "1500"]
runner = CliRunner()
# One intra-op thread here and in the subprocesses: on a small shared machine, spinning
# OpenMP threads slow a tiny model down tenfold; and the same count keeps results bitwise equal.
THREADS = 1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from torch_threads(THREADS)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """88 small noise images (each upscaled to a 27x27 patch grid) and 2 broken files."""
    folder = tmp_path_factory.mktemp("rel_images")
    rng = np.random.default_rng(0)
    for i in range(N_GOOD):
        h, w = 12 + i % 5, 16 + i % 7
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"img{i:03d}.png")
    for name, data in BROKEN.items():
        (folder / name).write_bytes(data)
    return folder


N_ITEMS = N_GOOD + len(BROKEN)
KEYS = sorted([f"img{i:03d}.png" for i in range(N_GOOD)] + list(BROKEN))  # in input order
N_PARTS = len(parts_of(KEYS, PART))


def options(images: Path, out: Path, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), config=CONFIG, random_init=True,
                device="cpu", part_images=PART, batch_tokens=1500, workers=0, progress=False)
    return EncodeOptions(**{**base, **changes})


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def clean(images, tmp_path_factory) -> list[dict]:
    """An uninterrupted run of the same inputs and settings."""
    out = tmp_path_factory.mktemp("rel_clean") / "e.parquet"
    summary = run_encode(options(images, out))
    assert summary.encoded == N_GOOD and summary.failed == len(BROKEN)
    return rows(out)


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    """Same rows in the same order: paths, sizes, grids, errors, embeddings bit for bit."""
    assert [r["path"] for r in got] == [r["path"] for r in want]
    assert len({r["path"] for r in got}) == N_ITEMS
    for a, b in zip(got, want):
        assert a == b, a["path"]


# --------------------------------------------------------------------------- interrupted runs

def start(images: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "COLUMNS": "300",
           "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    env.pop("DSV4ENC_WEIGHTS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "dsv4enc", "encode", str(images), "--out", str(out), *COMMON,
         "--workers", "1", "--log-every", "3600", *extra],  # the summary, no progress line
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def committed(partial: Path) -> dict:
    """The parts the manifest and its journal list (the manifest is replaced by rename, a
    journal line that is not whole is not read: never seen half-written)."""
    try:
        return load_manifest(partial / "_manifest.json")["parts"]
    except FileNotFoundError:
        return {}


class Interruption:
    """One run signalled after its first committed part; what it left behind."""

    def __init__(self, images: Path, root: Path, signum: int) -> None:
        self.signum = signum
        self.out = root / signal.Signals(signum).name / "e.parquet"
        self.partial = self.out.with_name("e.parquet.partial")
        self.pauses = Pauses(root / signal.Signals(signum).name / "pauses", "commit")
        self.proc = start(images, self.out, env=self.pauses.env())
        self.rc: int | None = None
        self.stderr = ""
        self.stop_seconds = 0.0
        self.parts_at_signal = 0


def interrupt_all(runs: list[Interruption]) -> None:
    """Signal each run while it waits at its first committed part (a pause point: however
    fast the machine, the run is mid-way), then let it go on; the --out file must not appear
    meanwhile. Then collect exit codes and stderr."""
    for run in runs:
        run.pauses.wait("commit", proc=run.proc)
        assert not run.out.exists(), "--out appeared before the run was complete"
        run.parts_at_signal = len(committed(run.partial))
        run.sent = time.monotonic()
        run.proc.send_signal(run.signum)
        run.pauses.release()  # the signal is pending: the run stops at its next check
    for run in runs:
        _, run.stderr = run.proc.communicate(timeout=300)
        run.rc = run.proc.returncode
        run.stop_seconds = time.monotonic() - run.sent


@pytest.fixture(scope="module")
def interrupted(images, tmp_path_factory) -> dict[int, Interruption]:
    root = tmp_path_factory.mktemp("rel_interrupted")
    runs = [Interruption(images, root, s) for s in (signal.SIGKILL, signal.SIGTERM,
                                                      signal.SIGINT)]
    try:
        interrupt_all(runs)
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
    # A copy of what the SIGINT run left, for the refusal tests (the tests below change the
    # originals).
    sigint = runs[-1]
    if sigint.partial.is_dir():
        shutil.copytree(sigint.partial, root / "kept.partial")
    return {run.signum: run for run in runs}


def check_left_behind(run: Interruption) -> dict:
    """Only whole parts: every part the journal lists lies inside the growing file, with its
    recorded rows; no --out."""
    assert not run.out.exists()
    parts = committed(run.partial)
    assert 1 <= len(parts) < N_PARTS, "the run finished before it could be interrupted"
    size = (run.partial / GROWING_NAME).stat().st_size
    for name, part in parts.items():
        assert part["offset"] + part["length"] <= size
        assert part["rows"] == part["end"] - part["start"]
    return parts


def test_sigkill_then_resume_equals_a_clean_run(interrupted, images, clean):
    run = interrupted[signal.SIGKILL]
    assert run.rc == -signal.SIGKILL
    parts = check_left_behind(run)
    # What a kill at a bad moment also leaves: a torn temporary part, and a part file that
    # was renamed into place but never recorded, empty where its data never reached the disk
    # (both must be encoded again, not trusted; a non-empty one is judged by its footer).
    (run.partial / ".part-000020.parquet.99-0badcafe.tmp").write_bytes(b"PAR1 torn")
    (run.partial / "part-000021.parquet").write_bytes(b"")
    with open(run.partial / GROWING_NAME, "ab") as growing:  # a part torn by the kill
        growing.write(b"half a part")
    summary = run_encode(options(images, run.out, resume=True))
    assert summary.reused == sum(p["end"] - p["start"] for p in parts.values())
    assert summary.encoded + summary.failed + summary.reused == N_ITEMS
    # every error row is counted: this run's, and those of the parts it reused
    assert summary.reused_failed == sum(p["failed"] for p in parts.values())
    assert summary.failed + summary.reused_failed == len(BROKEN)
    assert_same_rows(rows(run.out), clean)
    assert not run.partial.exists()


def test_a_stop_that_hangs_ends_the_process_after_the_grace(images, clean, tmp_path):
    """SIGTERM while the writer is held at a pause point that is never released (as a hung
    commit or worker would hold the stop): the process still ends, 143, in one line that
    says so and how to go on; what it committed is kept, and --resume finishes."""
    from dsv4enc.run.stopping import FORCE_EXIT_S

    out, report = tmp_path / "e.parquet", tmp_path / "summary.json"
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = start(images, out, "--summary-json", str(report), env=pauses.env())
    try:
        pauses.wait("commit", proc=proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # never released: the stop cannot finish by itself
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    assert time.monotonic() - sent >= FORCE_EXIT_S  # it was the grace that ended it
    lines = [line for line in stderr.strip().splitlines()
             if not line.startswith(("dsv4enc: encoding ", "dsv4enc: images "))]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "--resume" in lines[0], stderr
    assert f"did not stop within {FORCE_EXIT_S:g} s" in lines[0], stderr
    written = json.loads(report.read_text())  # the report asked for, before the exit
    assert (written["status"], written["exit_code"]) == ("interrupted", 143)
    assert committed(out.with_name("e.parquet.partial")), "the committed part was not kept"
    run_encode(options(images, out, resume=True))
    assert_same_rows(rows(out), clean)


def test_a_resumed_summary_counts_the_error_rows_of_the_parts_it_reused(tmp_path):
    """A broken image in the first part, committed before a SIGKILL: --resume reuses that
    part, and its summary counts the part's error row among the reused, hiding nothing."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a_broken.png").write_bytes(b"not an image")
    rng = np.random.default_rng(1)
    for i in range(2 * PART):
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(
            folder / f"img{i}.png")
    out, report = tmp_path / "e.parquet", tmp_path / "summary.json"
    pauses = Pauses(tmp_path / "pauses", "commit")
    proc = start(folder, out, env=pauses.env())
    try:
        pauses.wait("commit", proc=proc)
    finally:
        proc.kill()
        proc.communicate()
    resumed = start(folder, out, "--resume", "--summary-json", str(report))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    counts = json.loads(report.read_text())["images"]
    assert counts["reused"] >= 1 and (counts["reused_failed"], counts["failed"]) == (1, 0), err
    assert "1 failed image among them" in err


def test_sigterm_exits_143_with_a_resume_hint_then_resume_completes(interrupted, images,
                                                                     clean):
    run = interrupted[signal.SIGTERM]
    assert run.rc == 143, run.stderr
    assert run.stop_seconds < 20, run.stop_seconds
    lines = [line for line in run.stderr.strip().splitlines()  # but the opening line and
             if not line.startswith(("dsv4enc: encoding ", "dsv4enc: images "))]  # progress
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "--resume" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    check_left_behind(run)
    proc = start(images, run.out, "--resume")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "reused" in err
    assert_same_rows(rows(run.out), clean)
    assert not run.partial.exists()


def test_sigint_exits_130_keeps_parts_and_a_damaged_part_is_encoded_again(
        interrupted, images, clean):
    run = interrupted[signal.SIGINT]
    assert run.rc == 130, run.stderr
    assert "SIGINT" in run.stderr and "--resume" in run.stderr
    assert "Traceback" not in run.stderr
    parts = check_left_behind(run)
    # A recorded part whose bytes are not in the file is not trusted.
    data = load_manifest(run.partial / "_manifest.json")
    data["parts"]["part-000000"]["offset"] = (run.partial / GROWING_NAME).stat().st_size
    data.pop("journal")  # written whole: the journal no longer applies
    (run.partial / "_manifest.json").write_text(json.dumps(data))
    summary = run_encode(options(images, run.out, resume=True))
    # The signal commits the finished segments too: the last part may hold fewer than PART.
    assert summary.reused == sum(p["end"] - p["start"] for name, p in parts.items()
                                 if name != "part-000000")
    assert_same_rows(rows(run.out), clean)


# --------------------------------------------------------------------------- refusals

@pytest.fixture
def unfinished(interrupted, tmp_path) -> Path:
    """A copy of an interrupted run's parts folder, as ``tmp_path/e.parquet.partial``."""
    kept = interrupted[signal.SIGINT].out.parents[1] / "kept.partial"
    assert committed(kept), "the SIGINT run left no parts"
    target = tmp_path / "e.parquet.partial"
    shutil.copytree(kept, target)
    return target


def encode(images: Path, out: Path, *extra: str):
    return runner.invoke(app, ["encode", str(images), "--out", str(out), *COMMON, "--workers",
                               "0", "-q", *extra], env={"DSV4ENC_WEIGHTS": None,
                                                        "COLUMNS": "300"})


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    text = result.stderr.strip()
    assert "Traceback" not in result.output and len(text.splitlines()) == 1, text
    return text


@pytest.mark.parametrize("change, named", [
    (("--seed", "1"), "weights"),
    (("--dtype", "bfloat16"), "rerun with --dtype float32 to resume"),
    (("--features", "vit"), "rerun with --features aligner to resume"),
    (("--out-dtype", "float32"), "rerun with --out-dtype float16 to resume"),
    (("--pool", "mean"), "rerun with --pool none to resume"),
])
def test_resume_refuses_different_settings(unfinished, images, change, named):
    """A setting a flag chooses names the flag and value that would resume; the weights,
    which no flag of this run can bring back, only --overwrite."""
    before = sorted(p.name for p in unfinished.iterdir())
    line = one_line_error(encode(images, unfinished.with_name("e.parquet"), "--resume",
                                 *change), 2)
    assert "cannot resume" in line and named in line and "--overwrite" in line
    assert "encoded again" not in line and "another pyarrow" not in line
    assert sorted(p.name for p in unfinished.iterdir()) == before  # nothing touched


def test_existing_parts_need_resume_or_overwrite(unfinished, images, clean):
    out = unfinished.with_name("e.parquet")
    line = one_line_error(encode(images, out), 1)
    assert "--resume" in line and "--overwrite" in line and str(unfinished) in line
    one_line_error(encode(images, out, "--resume", "--overwrite"), 2)
    result = encode(images, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert "reused" not in result.stderr  # started over
    assert_same_rows(rows(out), clean)
    assert not unfinished.exists()
    # A complete output is not resumed (exit 0 and a note, as for a finished folder), nor
    # silently replaced.
    done = encode(images, out, "--resume")
    assert done.exit_code == 0 and done.stdout == f"{out}\n", done.output  # -q: the path
    assert_same_rows(rows(out), clean)
    assert "--overwrite" in one_line_error(encode(images, out), 1)


# --------------------------------------------------------------------------- prompt stops

def test_a_signal_while_reading_headers_stops_within_seconds(tmp_path, monkeypatch):
    """Reading a huge input set's headers takes minutes: a SIGTERM then must not wait for
    all of them (nor leave a parts folder behind when nothing was committed)."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{tmp_path}/img{i:05d}.png\n" for i in range(2000)))
    for i in range(2000):  # a list none of whose paths exists is refused before any header
        (tmp_path / f"img{i:05d}.png").touch()
    probed = []
    lock = threading.Lock()

    def slow_probe(item, max_pixels):
        with lock:
            probed.append(item)
            if len(probed) == 40:  # well into the header pass: the handler is installed
                os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        return Probe(width=20, height=20)

    monkeypatch.setattr(headers, "probe_image", slow_probe)
    out = tmp_path / "e.parquet"
    # one window of 2000 (the plan streams: with small parts, earlier windows would be
    # encoded and committed meanwhile, and kept for --resume)
    opts = options(tmp_path, out, inputs=[], files_from=str(listing), part_images=4096)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught:
        run_encode(opts)
    assert caught.value.exit_code == 143 and "SIGTERM" in str(caught.value)
    # The probes go on at 0.05 s each whatever the machine's speed: a run that waited for
    # them would have probed all 2000 (the in-flight ones finish; no new one starts).
    assert len(probed) < 2000, len(probed)
    assert not out.exists() and not out.with_name("e.parquet.partial").exists()
    assert signal.getsignal(signal.SIGTERM) is handler  # restored


# --------------------------------------------------------------------------- every phase stops

# Runs ``dsv4enc encode`` with one function replaced by one that says it was reached (a file
# appears) and then blocks for ten minutes: a phase that is slow or stuck at that point.
STUCK_RUN = """
import importlib, pathlib, sys, time
target, ready, *argv = sys.argv[1:]
module, _, attr = target.partition(":")
owner = importlib.import_module(module)
*outer, name = attr.split(".")
for part in outer:
    owner = getattr(owner, part)

def stuck(*args, **kwargs):
    pathlib.Path(ready).touch()
    time.sleep(600)

setattr(owner, name, stuck)
from dsv4enc.cli import main
sys.argv = ["dsv4enc", *argv]
main()
"""


class PhaseRun:
    """One ``encode`` process stopped by ``signum`` in one phase."""

    def __init__(self, root: Path, phase: str, signum: int, args: list[str],
                 target: str | None = None) -> None:
        self.phase, self.signum, self.target = phase, signum, target
        self.folder = root / phase
        self.folder.mkdir()
        self.out = self.folder / "e.parquet"
        self.ready = self.folder / "reached"
        self.fifo_fd: int | None = None
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300",
               "PYTHONPATH": str(REPO_ROOT)}
        env.pop("DSV4ENC_WEIGHTS", None)
        argv = ["encode", *args, "--out", str(self.out), *COMMON, "--workers", "1", "-q"]
        command = ([sys.executable, "-c", STUCK_RUN, target, str(self.ready), *argv]
                   if target else [sys.executable, "-m", "dsv4enc", *argv])
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True)
        self.stop_seconds = 0.0
        self.stderr = ""

    def reached(self) -> bool:
        return self.ready.exists()


def fifo_reader_waiting(run: PhaseRun, fifo: Path) -> bool:
    """True once the run has the FIFO open for reading (it then waits for lines in it)."""
    try:
        run.fifo_fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        return True
    except OSError:  # ENXIO: no reader yet
        return False


@pytest.fixture(scope="module")
def phase_runs(images, tmp_path_factory) -> dict[str, PhaseRun]:
    root = tmp_path_factory.mktemp("rel_phases")
    fifo = root / "listing.fifo"
    os.mkfifo(fifo)
    many = root / "many.txt"  # more inputs than one window: later windows are read meanwhile
    many.write_text("".join(f"{root}/empty{i:05d}.png\n" for i in range(5000)))
    for i in range(5000):  # they exist (a list of missing paths is refused before headers)
        (root / f"empty{i:05d}.png").touch()
    probe = "dsv4enc.images.headers:probe_image"
    runs = [
        PhaseRun(root, "discovery", signal.SIGINT, ["--files-from", str(fifo)]),
        PhaseRun(root, "header probes", signal.SIGTERM, [str(images)], probe),
        PhaseRun(root, "header probes of 5000", signal.SIGTERM, ["--files-from", str(many)],
                 probe),
        PhaseRun(root, "model loading", signal.SIGTERM, [str(images)],
                 "dsv4enc.run.pipeline:load_model"),
        PhaseRun(root, "planning", signal.SIGINT, [str(images)],
                 "dsv4enc.run.setup:plan_segments"),
        PhaseRun(root, "assembling", signal.SIGTERM, [str(images)],
                 "dsv4enc.output.appending:AppendingStore.finish"),
    ]
    try:
        pending = list(runs)
        deadline = time.monotonic() + 180
        while pending:
            assert time.monotonic() < deadline, [run.phase for run in pending]
            for run in list(pending):
                if run.proc.poll() is not None:
                    pytest.fail(f"{run.phase}: ended (rc {run.proc.returncode}) before the "
                                f"signal: {run.proc.communicate()[1][-2000:]}")
                ready = fifo_reader_waiting(run, fifo) if run.target is None else run.reached()
                if ready:
                    time.sleep(0.2)  # well inside the blocking call
                    sent = time.monotonic()
                    run.proc.send_signal(run.signum)
                    try:
                        run.stderr = run.proc.communicate(timeout=30)[1]
                    finally:
                        run.stop_seconds = time.monotonic() - sent
                        if run.fifo_fd is not None:
                            os.close(run.fifo_fd)
                    pending.remove(run)
            time.sleep(0.05)
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
    return {run.phase: run for run in runs}


@pytest.mark.parametrize("phase", ["discovery", "header probes", "header probes of 5000",
                                   "model loading", "planning", "assembling"])
def test_a_signal_stops_every_phase_within_seconds(phase_runs, phase):
    """SIGINT/SIGTERM while the run is stuck in each phase before and after encoding
    (encoding itself: the tests above): exit 130/143 within seconds, one line, no
    traceback, no output file."""
    run = phase_runs[phase]
    assert run.proc.returncode == 128 + run.signum, run.stderr[-2000:]
    assert run.stop_seconds < 10
    assert "Traceback" not in run.stderr
    assert f"interrupted by {signal.Signals(run.signum).name}" in run.stderr
    assert not run.out.exists()
    if phase == "assembling":  # the parts are kept for --resume
        assert "--resume" in run.stderr and committed(run.out.with_name("e.parquet.partial"))


# --------------------------------------------------------------------------- non-finite output

def test_the_api_never_returns_a_non_finite_embedding(images):
    """The same check as the command line's: float16 output that overflows raises, naming the
    image, for ``encode`` and ``encode_iter`` alike; float32 output then holds the values."""
    from dsv4enc import EncodeError, Encoder

    loud = Encoder.from_config(CONFIG, device="cpu", dtype="float32", out_dtype="float16")
    quiet = Encoder.from_config(CONFIG, device="cpu", dtype="float32", out_dtype="float32")
    for encoder in (loud, quiet):
        with torch.no_grad():
            for parameter in (encoder.model.aligner.w2.weight, encoder.model.aligner.w2.bias):
                parameter.mul_(1e6)  # outputs past float16's 65504
    paths = [str(images / "img000.png"), str(images / "img001.png")]
    with pytest.raises(EncodeError) as caught:
        loud.encode(paths)
    assert caught.value.index == 0 and caught.value.key == paths[0]
    assert "not finite in float16" in str(caught.value) and "float32" in str(caught.value)
    with pytest.raises(EncodeError, match="not finite in float16"):
        list(loud.encode_iter(paths))
    values = quiet.encode(paths)
    assert all(torch.isfinite(v).all() and v.abs().max() > 65504 for v in values)
    with torch.no_grad():
        quiet.model.aligner.w2.bias.fill_(float("nan"))  # float32 output: the weights' doing
        loud.model.aligner.w2.bias.fill_(float("nan"))  # NaN: no cast to float16 makes it
    with pytest.raises(EncodeError, match="not finite in float32; .*check the weights"):
        quiet.encode(paths)
    with pytest.raises(EncodeError, match="not finite in float16; .*check the weights"):
        loud.encode(paths)


# Runs ``dsv4enc encode`` whose first image turns into a FIFO once the headers are read (so
# its decode hangs in the worker), and says (a file appears) when encoding has begun.
HUNG_DECODE_RUN = """
import os, pathlib, sys
from dsv4enc.run import encoding
from dsv4enc.run import setup as prefetch
victim, ready, *argv = sys.argv[1:]
real_read, real_submit = prefetch.probe_share, encoding.PartEncoder.submit_batch

def read_then_swap(*args, **kwargs):
    planned = real_read(*args, **kwargs)
    os.unlink(victim)
    os.mkfifo(victim)
    return planned

def submit_batch(self, *args, **kwargs):
    pathlib.Path(ready).touch()
    return real_submit(self, *args, **kwargs)

prefetch.probe_share = read_then_swap
encoding.PartEncoder.submit_batch = submit_batch
from dsv4enc.cli import main
sys.argv = ["dsv4enc", *argv]
main()
"""


def test_a_signal_does_not_wait_for_a_hung_decode(images, tmp_path):
    """Encoding waits for a decode that hangs (up to --decode-timeout, 60 s here): SIGTERM
    still stops the run within seconds."""
    folder = tmp_path / "in"
    shutil.copytree(images, folder)
    ready, out = tmp_path / "encoding", tmp_path / "e.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("DSV4ENC_WEIGHTS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG_DECODE_RUN, str(folder / "img000.png"), str(ready),
         "encode", str(folder), "--out", str(out), *COMMON, "--workers", "1", "-q",
         "--decode-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "encoding never began"
            time.sleep(0.05)
        time.sleep(0.5)  # waiting for img000.png's decode
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=50)
        assert time.monotonic() - sent < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr[-2000:]
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    assert not out.exists()
