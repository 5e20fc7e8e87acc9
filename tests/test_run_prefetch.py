"""The head start: decode workers fed by a background thread, and a run planned and decoding
before torch is imported. Each path must give exactly what the plain path gives."""

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

from dsv4enc.images.decode import DecodePool, decode_image
from dsv4enc.run.options import EncodeOptions
from dsv4enc.run.pipeline import run_encode
from collections import Counter

import dsv4enc.run.setup as run_setup
from dsv4enc.run.plan import decode_order, images_per_part, plan_batches, plan_parts, segment_tokens
from dsv4enc.run.setup import RunSetup, start_prefetch

from helpers import write_image

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


# --------------------------------------------------------------------------- prefetch

def options(images: Path, out: Path, ckpt: Path, **changes) -> EncodeOptions:
    base = dict(inputs=[str(images)], out=str(out), weights=str(ckpt), device="cpu",
                dtype="float32", batch_tokens=256, max_images=3, workers=1, progress=False)
    return EncodeOptions(**{**base, **changes})


def read(path: Path) -> pa.Table:
    return pq.read_table(path).replace_schema_metadata(None)


def test_a_prefetched_run_equals_a_plain_run(images, tmp_path, tiny_ckpt, tiny_cfg):
    plain = options(images, tmp_path / "plain.parquet", tiny_ckpt)
    run_encode(plain)
    opts = replace(plain, out=str(tmp_path / "early.parquet"))
    prefetch = start_prefetch(opts)
    assert prefetch is not None and prefetch.pool is not None and prefetch.decoded is not None
    assert prefetch.on_cpu and prefetch.early
    parts = plan_parts(prefetch.planned, images_per_part(tiny_cfg, opts),
                       segment_tokens=segment_tokens(256, "cpu"))
    assert [p.name for p in prefetch.parts] == [p.name for p in parts]
    assert prefetch.order == decode_order(plan_batches(prefetch.planned, parts, 256, 3))
    summary = run_encode(opts, None, prefetch)
    assert summary.encoded == len(SIZES) and summary.failed == 1
    assert prefetch.pool.workers == [] and prefetch.decoded is None  # closed by the run
    assert read(tmp_path / "early.parquet").equals(read(tmp_path / "plain.parquet"))


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Calls of the set-up's seams: discovery, the worker default, headers, parts, batches
    (with the decode order) and the decode pool's ``imap``."""
    counts: Counter = Counter()

    def count(owner, name):
        real = getattr(owner, name)

        def counting(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    for name in ("discover", "default_workers", "read_headers", "plan_parts", "plan_batches",
                 "decode_order"):
        count(run_setup, name)
    count(DecodePool, "imap")
    return counts


ONCE = {name: 1 for name in ("discover", "default_workers", "read_headers", "plan_parts",
                             "plan_batches", "decode_order", "imap")}


@pytest.mark.parametrize("early", ["planned", "inputs only", "none"])
def test_discovery_plan_and_order_are_made_once(images, tmp_path, tiny_ckpt, counted, early):
    """Whoever makes them first (the early start, else the run), the inputs are found, the
    worker default computed, the headers read, the parts cut, the batches and decode order
    planned and the stream started once each; the run uses what the early start made."""
    plain = options(images, tmp_path / "plain.parquet", tiny_ckpt, workers=None)
    run_encode(plain)
    assert dict(counted) == ONCE
    counted.clear()
    opts = replace(plain, out=str(tmp_path / "o.parquet"))
    setup = None
    if early != "none":
        setup = start_prefetch(opts if early == "planned" else replace(opts, resume=True))
        assert setup.early == (early == "planned")
    summary = run_encode(opts, None, setup)
    assert summary.encoded == len(SIZES) and dict(counted) == ONCE
    assert read(tmp_path / "o.parquet").equals(read(tmp_path / "plain.parquet"))


def test_the_early_plan_is_used_as_it_is(images, tmp_path, tiny_ckpt, monkeypatch):
    """Nothing the early start made is made again or compared: planning in the run
    would fail here."""
    plain = options(images, tmp_path / "plain.parquet", tiny_ckpt)
    run_encode(plain)
    opts = replace(plain, out=str(tmp_path / "early.parquet"))
    prefetch = start_prefetch(opts)
    stream, parts = prefetch.decoded, prefetch.parts

    def made_again(*args, **kwargs):
        raise AssertionError("made again")

    for name in ("discover", "read_headers", "plan_parts", "plan_batches", "decode_order"):
        monkeypatch.setattr(run_setup, name, made_again)
    monkeypatch.setattr(DecodePool, "imap", made_again)
    monkeypatch.setattr(DecodePool, "__init__", made_again)
    run_encode(opts, None, prefetch)
    assert prefetch.parts is parts and stream is not None and prefetch.decoded is None
    assert read(tmp_path / "early.parquet").equals(read(tmp_path / "plain.parquet"))


@pytest.mark.parametrize("changes", [dict(resume=True), dict(workers=0), dict(device="mps"),
                                     dict(weights="owner/not-a-local-folder")])
def test_runs_that_could_differ_only_hand_on_their_inputs(images, tmp_path, tiny_ckpt, changes):
    prefetch = start_prefetch(options(images, tmp_path / "o.parquet", tiny_ckpt, **changes))
    assert isinstance(prefetch, RunSetup) and prefetch.pool is None
    assert prefetch.on_cpu == ("device" not in changes)
    assert len(prefetch.found.items) == len(SIZES) + 1


def test_a_plan_for_another_device_is_dropped(images, tmp_path, tiny_ckpt, tiny_cfg):
    """Planned for CUDA (its batch size, its worker count) but torch runs on the CPU: the
    run makes its own plan and pool, and gives the plain run's rows."""
    plain = options(images, tmp_path / "plain.parquet", tiny_ckpt, batch_tokens=None)
    run_encode(plain)
    early = replace(plain, out=str(tmp_path / "early.parquet"), device="cuda")
    prefetch = start_prefetch(early)
    assert prefetch.device_type == "cuda" and prefetch.pool is not None
    run_encode(replace(early, device="cpu"), None, prefetch)
    assert prefetch.pool.workers == []
    assert read(tmp_path / "early.parquet").equals(read(tmp_path / "plain.parquet"))


def test_no_prefetch_under_torchrun(images, tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert start_prefetch(options(images, tmp_path / "o.parquet", tiny_ckpt)) is None
