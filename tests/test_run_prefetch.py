"""The streaming set-up: decode workers fed by a background thread, the inputs listed before
torch is imported, and the plan made a window at a time a bounded distance ahead of the
encoder. Each path must give exactly what the plain path gives."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4enc.images.decode import NOT_YET, DecodePool, decode_image
from dsv4enc.run.options import EncodeOptions
from dsv4enc.run.pipeline import run_encode

import dsv4enc.run.setup as run_setup
from dsv4enc.run.setup import WINDOWS_AHEAD, RunSetup, Window, Windows, start_prefetch

from helpers import parts_of, write_image

SIZES = [(40, 30), (90, 60), (25, 70), (64, 64), (120, 33), (31, 31)]


def wait_until(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def images(tmp_path: Path) -> Path:
    folder = tmp_path / "images"
    for i, size in enumerate(SIZES):
        write_image(folder / f"img{i}.png", size)
    (folder / "broken.jpg").write_bytes(b"not an image")
    return folder


class CountingTasks:
    """An iterator of ``(tag, path)`` tasks that records how many were taken."""

    def __init__(self, paths) -> None:
        self.paths, self.taken = list(paths), 0

    def __iter__(self):
        for i, path in enumerate(self.paths):
            self.taken += 1
            yield i, path


# --------------------------------------------------------------------------- decode pump

def test_workers_decode_ahead_while_the_consumer_is_busy(images, tiny_cfg):
    """Nothing is consumed, yet the window's images get decoded (the background thread
    collects them), and no task beyond the window is taken."""
    paths = sorted(images.glob("img*.png"))
    tasks = CountingTasks(paths)
    with DecodePool(tiny_cfg, 1, timeout_s=60.0) as pool:
        stream = pool.imap(tasks, window=3)
        assert wait_until(lambda: tasks.taken == 3 and pool.workers[0].task is None)
        time.sleep(0.2)
        assert tasks.taken == 3  # bounded: the consumer has not taken anything yet
        got = [next(stream) for _ in range(3)]
        assert wait_until(lambda: tasks.taken == len(paths))
        got += list(stream)
    assert [tag for tag, _ in got] == list(range(len(paths)))
    for (_, decoded), path in zip(got, paths):
        want = decode_image(path, tiny_cfg)
        assert np.array_equal(decoded.patches, want.patches)


def test_closing_the_pool_stops_an_abandoned_stream(images, tiny_cfg):
    paths = sorted(images.glob("img*.png"))
    pool = DecodePool(tiny_cfg, 1, timeout_s=60.0)
    stream = pool.imap(((i, p) for i, p in enumerate(paths)), window=2)
    next(stream)
    began = time.monotonic()
    pool.close()
    assert time.monotonic() - began < 10
    assert not any(t.name == "dsv4enc-decode" and t.is_alive() for t in threading.enumerate())


def test_a_consumer_waiting_when_the_pool_closes_gets_an_error(images, tiny_cfg):
    fifo = images / "hang.png"
    os.mkfifo(fifo)  # opening it blocks: the consumer waits until the pool is closed
    pool = DecodePool(tiny_cfg, 1, timeout_s=60.0)
    stream = pool.imap([(0, str(fifo))], window=1)
    threading.Timer(1.0, pool.close).start()
    with pytest.raises(RuntimeError, match="decoding was stopped"):
        next(stream)


def test_an_error_in_the_task_source_reaches_the_consumer(images, tiny_cfg):
    paths = sorted(images.glob("img*.png"))

    def tasks():
        yield 0, paths[0]
        raise RuntimeError("listing failed")

    with DecodePool(tiny_cfg, 1, timeout_s=60.0) as pool:
        stream = pool.imap(tasks(), window=4)
        assert next(stream)[0] == 0
        with pytest.raises(RuntimeError, match="listing failed"):
            next(stream)


def test_a_task_source_that_is_not_ready_yet_is_asked_again(images, tiny_cfg):
    """A streaming plan's source says NOT_YET until its next window is planned: the pump
    keeps delivering what it has and takes the rest once it comes."""
    paths = sorted(images.glob("img*.png"))
    gate = threading.Event()

    def tasks():
        yield 0, paths[0]
        while not gate.is_set():
            yield NOT_YET
        yield from ((i, p) for i, p in enumerate(paths) if i)

    with DecodePool(tiny_cfg, 1, timeout_s=60.0) as pool:
        stream = pool.imap(tasks(), window=4)
        assert next(stream)[0] == 0  # delivered while the source is not ready
        gate.set()
        assert [tag for tag, _ in stream] == list(range(1, len(paths)))


# --------------------------------------------------------------------------- the streaming plan

def options(images: Path, out: Path, ckpt: Path, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), weights=str(ckpt), device="cpu",
                dtype="float32", batch_tokens=256, max_images=3, workers=1, progress=False)
    return EncodeOptions(**{**base, **changes})


def read(path: Path) -> pa.Table:
    return pq.read_table(path).replace_schema_metadata(None)


def test_the_listed_inputs_are_handed_on(images, tmp_path, tiny_ckpt, monkeypatch):
    """What the command line lists before torch is imported is what the run encodes:
    nothing is walked twice."""
    plain = options(images, tmp_path / "plain.parquet", tiny_ckpt)
    run_encode(plain)
    opts = replace(plain, out=str(tmp_path / "early.parquet"))
    setup = start_prefetch(opts)
    assert isinstance(setup, RunSetup) and len(setup.planned) >= 1

    def made_again(*args, **kwargs):
        raise AssertionError("listed again")

    monkeypatch.setattr(run_setup, "stream_inputs", made_again)
    summary = run_encode(opts, None, setup)
    assert summary.encoded == len(SIZES) and summary.failed == 1
    assert setup.pool.workers == [] and setup.decoded is None  # closed by the run
    assert read(tmp_path / "early.parquet").equals(read(tmp_path / "plain.parquet"))


@pytest.fixture
def probed(monkeypatch) -> list[list[str]]:
    """The keys of each call of the windows' probe seam (``plan.probe_share``)."""
    calls: list[list[str]] = []
    real = run_setup.probe_share

    def counting(items, *args, **kwargs):
        calls.append([item.key for item in items])
        return real(items, *args, **kwargs)

    monkeypatch.setattr(run_setup, "probe_share", counting)
    return calls


def test_each_window_is_probed_once_and_rows_equal_one_window(images, tmp_path, tiny_ckpt,
                                                                 probed):
    """Parts of about 2 inputs: 3 windows, each probed once, in input order; the rows equal
    a run planned in one window (rows are batch-invariant)."""
    run_encode(options(images, tmp_path / "one.parquet", tiny_ckpt, part_images=1000))
    assert len(probed) == 1
    probed.clear()
    summary = run_encode(options(images, tmp_path / "many.parquet", tiny_ckpt, part_images=2))
    keys = sorted(p.name for p in images.iterdir())
    assert probed == [keys[start:end] for start, end in parts_of(keys, 2)]
    assert len(probed) == 3
    assert summary.encoded == len(SIZES) and summary.failed == 1
    assert read(tmp_path / "many.parquet").equals(read(tmp_path / "one.parquet"))


def test_resume_reads_no_header_of_a_committed_part(images, tmp_path, tiny_ckpt, probed):
    """--resume tells committed parts unchanged by their inputs' stamps: an unchanged
    output probes nothing; a changed input costs the probes of its part alone."""
    out = tmp_path / "out"
    run_encode(options(images, f"{out}/", tiny_ckpt, part_images=2))
    probed.clear()
    assert run_encode(options(images, f"{out}/", tiny_ckpt, part_images=2,
                              resume=True)).reused == len(SIZES) + 1
    assert probed == []
    keys = sorted(p.name for p in images.iterdir())
    os.utime(images / keys[3], ns=(time.time_ns(), time.time_ns() + 10**9))
    summary = run_encode(options(images, f"{out}/", tiny_ckpt, part_images=2, resume=True))
    (start, end), = [(start, end) for start, end in parts_of(keys, 2) if start <= 3 < end]
    assert probed == [keys[start:end]] and summary.reused == len(keys) - (end - start)
    run_encode(options(images, tmp_path / "clean.parquet", tiny_ckpt, part_images=2))
    assert pq.read_table(out).sort_by("path").replace_schema_metadata(None).equals(
        read(tmp_path / "clean.parquet"))


def test_windows_are_planned_a_bounded_distance_ahead():
    """The planner reads at most WINDOWS_AHEAD windows beyond the one being encoded; the
    decode source and the encoder each walk every window."""
    read: list[int] = []
    todo = [run_setup.Part(f"p{k}", k, k + 1, range(k, k + 1), "") for k in range(8)]
    windows = Windows(todo, lambda part: read.append(part.start),
                      lambda part, done: Window([part], [[[part.start]]],
                                                [(part.start, None)], 1), alone=True)
    try:
        assert wait_until(lambda: windows.blocked)
        assert read == list(range(WINDOWS_AHEAD + 1))  # the bound holds while nothing moves
        tasks = windows.tasks()
        assert [next(tasks) for _ in range(2)] == [(0, None), (1, None)]
        assert windows.window(3).segments == [todo[3]]
        assert wait_until(lambda: windows.blocked and len(read) >= 3 + WINDOWS_AHEAD + 1)
        assert len(read) == 3 + WINDOWS_AHEAD + 1
        windows.window(7)  # the encoder at the last window: every window is planned
        assert [t for t in tasks if t is not NOT_YET] == [(k, None) for k in range(2, 8)]
    finally:
        windows.close()


def test_no_prefetch_under_torchrun(images, tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert start_prefetch(options(images, tmp_path / "o.parquet", tiny_ckpt)) is None


def test_a_window_looks_up_the_carried_inputs_without_copying_them():
    """``--update`` carries up to every input's row: planning one window's batches looks its
    inputs up in them, never walks them all (a copy per window was quadratic in the inputs)."""
    from dsv4enc.images.headers import Planned
    from dsv4enc.images.items import InputItem
    from dsv4enc.run.plan import Part, plan_batches

    class Carried(dict):
        def __iter__(self):
            raise AssertionError("the carried inputs were walked whole")

    planned = [Planned(InputItem(f"{i}.png", f"{i}.png"), 8, 8, 2, 2) for i in range(10)]
    carried = Carried({i: i for i in range(0, 10, 2)})
    part = Part("part-000000", 0, 10, range(10), "")
    assert plan_batches(planned, [part], 64, None, carried) == [[[[1, 3, 5, 7, 9]]]]
