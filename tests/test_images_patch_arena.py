"""Decode workers hand their patches over in shared memory (``patch_arena.PatchArena``)
instead of pickling them through a pipe, and ``pack`` copies them straight into the engine's staging
buffer. Each fast path must give exactly what the simple one gives, and the shared memory must
be bounded and released whatever happens to a worker."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4enc.images.decode import DecodePool, decode_image, patch_slot_bytes
from dsv4enc.engine.packing import concat_patches, pack

from helpers import random_patch_items, write_image

SIZES = [(40, 30), (90, 60), (25, 70), (64, 64), (120, 33), (31, 31)]

linux_only = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")


@pytest.fixture
def paths(tmp_path: Path) -> list[str]:
    folder = tmp_path / "images"
    out = []
    for i, size in enumerate(SIZES):
        write_image(folder / f"img{i}.png", size)
        out.append(str(folder / f"img{i}.png"))
    return out


def arena_fds() -> list[str]:
    """This process's open descriptors of decode arenas (memfd links name them)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "dsv4enc-patches" in target:
            found.append(target)
    return found


def in_slot(patches: np.ndarray) -> bool:
    """The array is a view over shared memory (a lease), not a copy out of a pipe."""
    base = patches.base
    return (isinstance(base, np.ndarray) and isinstance(base.base, memoryview)
            and isinstance(base.base.obj, mmap.mmap))


def arena_maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum("dsv4enc-patches" in line for line in maps)


def assert_same(got, path: str, cfg) -> None:
    want = decode_image(path, cfg)
    assert got.error is None, got.error
    assert (got.n_h, got.n_w, got.width, got.height) == (want.n_h, want.n_w, want.width,
                                                        want.height)
    assert got.patches.dtype == want.patches.dtype and got.patches.shape == want.patches.shape
    assert np.array_equal(got.patches, want.patches)


@linux_only
def test_patches_from_shared_slots_equal_an_inline_decode(paths, tiny_cfg):
    with DecodePool(tiny_cfg, 2, timeout_s=60.0) as pool:
        assert pool.arena is not None
        slots = pool.arena.slots
        results = list(pool.imap(list(enumerate(paths)), window=4))
        # every result is a view over a slot (no copy), so every one holds its slot
        assert pool.arena.free == slots - len(paths)
        for (i, got), path in zip(results, paths):
            assert in_slot(got.patches)
            assert_same(got, path, tiny_cfg)
        del results, got
        gc.collect()
        assert pool.arena.free == slots  # dropped: the slots are free again


@linux_only
def test_with_few_slots_the_rest_go_through_the_pipe_and_are_equal(paths, tiny_cfg):
    with DecodePool(tiny_cfg, 1, timeout_s=60.0, slots=2) as pool:
        results = list(pool.imap(list(enumerate(paths)), window=len(paths)))
        assert pool.arena.free == 0
        in_slots = [d for _, d in results if in_slot(d.patches)]
        assert len(in_slots) == 2  # held by the consumer: the others were pickled
        for (_, got), path in zip(results, paths):
            assert_same(got, path, tiny_cfg)


def test_without_slots_everything_goes_through_the_pipe(paths, tiny_cfg):
    with DecodePool(tiny_cfg, 1, timeout_s=60.0, slots=0) as pool:
        assert pool.arena is None
        for (_, got), path in zip(pool.imap(list(enumerate(paths))), paths):
            assert not in_slot(got.patches)
            assert_same(got, path, tiny_cfg)


@linux_only
def test_a_slot_is_released_when_its_worker_times_out_or_is_killed(paths, tmp_path, tiny_cfg):
    hang = tmp_path / "hang.png"
    os.mkfifo(hang)  # opening it blocks: the worker holds its slot until it is killed
    with DecodePool(tiny_cfg, 1, timeout_s=2.0, slots=3) as pool:
        tasks = [("a", paths[0]), ("hang", str(hang)), ("b", paths[1])]
        results = dict(pool.imap(tasks, window=3))
        assert results["hang"].error == "decode timed out after 2s"
        assert pool.replaced == 1
        assert_same(results["a"], paths[0], tiny_cfg)
        assert_same(results["b"], paths[1], tiny_cfg)
        del results
        gc.collect()
        assert pool.arena.free == 3

    stuck = tmp_path / "stuck.png"
    os.mkfifo(stuck)
    with DecodePool(tiny_cfg, 1, timeout_s=60.0, slots=3) as pool:
        worker = pool.workers[0].proc
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        results = dict(pool.imap([("stuck", str(stuck)), ("a", paths[0])], window=2))
        assert "decoder crashed" in results["stuck"].error
        assert_same(results["a"], paths[0], tiny_cfg)
        del results
        gc.collect()
        assert pool.arena.free == 3


@linux_only
def test_the_arena_is_freed_at_close_and_never_named_in_dev_shm(paths, tiny_cfg):
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    fds_before, maps_before = len(arena_fds()), arena_maps()
    pool = DecodePool(tiny_cfg, 2, timeout_s=60.0)
    kept = list(pool.imap(list(enumerate(paths))))
    assert len(arena_fds()) > fds_before and arena_maps() > maps_before
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) == shm_before  # anonymous: no name to leak
    pool.close()
    assert_same(kept[0][1], paths[0], tiny_cfg)  # a lease outlives the pool, still valid
    del kept
    gc.collect()
    # the last lease gone: unmapped and closed, so the kernel frees the memory
    assert arena_maps() == maps_before and len(arena_fds()) == fds_before


@linux_only
def test_an_image_larger_than_a_slot_goes_through_the_pipe(paths, tiny_cfg, monkeypatch):
    import dsv4enc.images.decode as decode

    # the pool's own slots fit the largest image the config allows
    assert patch_slot_bytes(tiny_cfg) == 3402 * tiny_cfg.patch_dim * 2
    monkeypatch.setattr(decode, "patch_slot_bytes", lambda cfg: 780 * cfg.patch_dim * 2)
    with DecodePool(tiny_cfg, 1, timeout_s=60.0, slots=len(paths)) as pool:
        results = list(pool.imap(list(enumerate(paths)), window=len(paths)))
        for (_, got), path in zip(results, paths):
            assert in_slot(got.patches) == (got.n_h * got.n_w <= 780)
            assert_same(got, path, tiny_cfg)
        assert any(not in_slot(got.patches) for _, got in results)
        del results, got
        gc.collect()
        assert pool.arena.free == len(paths)  # those offered to the large ones came back


def test_pack_into_a_staging_buffer_equals_plain_pack(tiny_cfg):
    items = random_patch_items([(3, 5), (7, 2), (1, 1), (6, 6)], tiny_cfg.patch_dim)
    made = []

    def buffer(tokens, width, dtype):
        made.append(torch.full((tokens, width), float("nan"), dtype=dtype))
        return made[-1]

    plain = pack(items, 3, "aligner")
    staged = pack(items, 3, "aligner", buffer)
    assert staged.patches is made[0]  # written in place: no second copy
    assert torch.equal(staged.patches.view(torch.int16), plain.patches.view(torch.int16))
    assert torch.equal(plain.patches, torch.cat([p for p, _, _ in items]))
    for name in ("positions", "merge_index", "merge_mask"):
        assert torch.equal(getattr(staged, name), getattr(plain, name))
    # other dtypes and strided inputs take the same path and give what torch.cat gives
    wide = [torch.randn(5, 4), torch.randn(4, 3).t()]
    assert torch.equal(concat_patches(wide), torch.cat(wide))


def test_a_run_gives_the_same_file_through_slots_pipes_or_inline(paths, tmp_path, tiny_ckpt,
                                                                 monkeypatch):
    """The whole encode: shared slots (default), pipes only (no slots), no workers."""
    import pyarrow.parquet as pq

    import dsv4enc.images.decode as decode
    from dsv4enc.run.options import EncodeOptions
    from dsv4enc.run.pipeline import run_encode

    def encode(name: str, workers: int = 1):
        opts = EncodeOptions(inputs=[str(Path(paths[0]).parent)], out=str(tmp_path / name),
                             weights=str(tiny_ckpt), device="cpu", dtype="float32",
                             batch_tokens=2048, max_images=3, workers=workers, progress=False)
        assert run_encode(opts).encoded == len(paths)
        return pq.read_table(tmp_path / name).replace_schema_metadata(None)

    shared = encode("shared.parquet")
    monkeypatch.setattr(decode, "default_slots", lambda workers: 0)
    assert encode("piped.parquet").equals(shared)
    assert encode("inline.parquet", workers=0).equals(shared)


KILLED_PARENT = """
import os, signal, sys, time
from dsv4enc.tower.config import VisionConfig
from dsv4enc.images.decode import DecodePool
pool = DecodePool(VisionConfig.from_file(sys.argv[1]), 1, timeout_s=600.0)
stream = pool.imap([(0, sys.argv[2])], window=1)  # a FIFO: the worker holds its slot
deadline = time.monotonic() + 600  # a hang guard: the worker takes its slot when it can
while pool.workers[0].slot is None:
    assert time.monotonic() < deadline
    time.sleep(0.01)
print(pool.workers[0].proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@linux_only
def test_nothing_is_left_when_the_main_process_is_killed(tmp_path):
    import subprocess

    from helpers import CONFIGS, REPO_ROOT, processes_gone

    fifo = tmp_path / "hang.png"
    os.mkfifo(fifo)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = subprocess.run([sys.executable, "-c", KILLED_PARENT, str(CONFIGS / "tiny.json"),
                           str(fifo)], stdout=subprocess.PIPE, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == -signal.SIGKILL
    worker = int(proc.stdout.split()[0])
    # The worker, which held a slot, ended with its parent: no process holds the arena any
    # more, so the kernel has freed it; it never had a name (in /dev/shm) to leak.
    assert processes_gone([worker])
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) == shm_before


# --------------------------------------------------------------------------- pixels for the device

def assert_same_pixels(got, path: str, cfg) -> None:
    """A decode for the transform on the device: the image's pixels, and the grid a host
    decode plans, whose patches ``transform.pixels_to_patches`` makes bit for bit."""
    from dsv4enc.tower.transform import pixels_to_patches

    want = decode_image(path, cfg)
    assert got.error is None and got.patches is None and got.pixels.dtype == np.uint8
    assert (got.n_h, got.n_w, got.width, got.height) == (want.n_h, want.n_w, want.width,
                                                        want.height)
    assert got.pixels.shape[:2] == (got.height, got.width)
    patches, _ = pixels_to_patches(torch.from_numpy(got.pixels), cfg)
    assert np.array_equal(patches.view(torch.int16).numpy().view(np.uint16), want.patches)


@linux_only
def test_pixels_for_the_device_come_through_shared_slots(paths, tiny_cfg):
    with DecodePool(tiny_cfg, 2, timeout_s=60.0, pixels=True) as pool:
        slots = pool.arena.slots
        results = list(pool.imap(list(enumerate(paths)), window=4))
        for (_, got), path in zip(results, paths):
            assert in_slot(got.pixels)
            assert_same_pixels(got, path, tiny_cfg)
        del results, got
        gc.collect()
        assert pool.arena.free == slots


def test_pixels_for_the_device_inline_and_through_pipes(paths, tiny_cfg, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    for workers, slots in ((0, None), (1, 0)):
        with DecodePool(tiny_cfg, workers, timeout_s=60.0, slots=slots, pixels=True) as pool:
            results = list(pool.imap(list(enumerate([*paths, str(bad)]))))
            for (_, got), path in zip(results, paths):
                assert_same_pixels(got, path, tiny_cfg)
            assert results[-1][1].error and results[-1][1].pixels is None  # still one error


def test_a_photo_larger_than_a_slot_is_transformed_by_its_decoder(paths, tiny_cfg, monkeypatch):
    import dsv4enc.images.decode as decode

    monkeypatch.setattr(decode, "patch_slot_bytes", lambda cfg: 60 * 60 * 3)
    with DecodePool(tiny_cfg, 0, pixels=True) as pool:  # inline: the patched bound applies
        for (_, got), path in zip(pool.imap(list(enumerate(paths))), paths):
            width, height = got.width, got.height
            if width * height * 3 <= 60 * 60 * 3:
                assert_same_pixels(got, path, tiny_cfg)
            else:
                assert got.pixels is None
                assert_same(got, path, tiny_cfg)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_run_with_the_transform_on_the_device_gives_the_same_file(paths, tmp_path, tiny_ckpt,
                                                                    workers):
    """``--transform device`` on the CPU: the same rows, bit for bit, as Pillow's path; a bad
    file is one error row in both."""
    import pyarrow.parquet as pq

    from dsv4enc.run.options import EncodeOptions
    from dsv4enc.run.pipeline import run_encode

    folder = Path(paths[0]).parent
    write_image(folder / "grey.png", (45, 20), "L")
    (folder / "broken.png").write_bytes(b"not an image")

    def encode(transform: str):
        out = tmp_path / f"{transform}-{workers}.parquet"
        opts = EncodeOptions(inputs=[str(folder)], out=str(out), weights=str(tiny_ckpt),
                             device="cpu", dtype="float32", batch_tokens=2048, max_images=3,
                             workers=workers, progress=False, transform=transform)
        summary = run_encode(opts)
        assert (summary.encoded, summary.failed) == (len(paths) + 1, 1)
        return pq.read_table(out).replace_schema_metadata(None)

    assert encode("device").equals(encode("host"))


def test_an_image_whose_device_transform_fails_is_one_error_row(paths, tmp_path, tiny_ckpt,
                                                               monkeypatch):
    """The device's memory can run out for one image: that image is an error row, the others
    are encoded as with the host's transform."""
    import pyarrow.parquet as pq

    from dsv4enc.engine.engine import Engine
    from dsv4enc.run.options import EncodeOptions
    from dsv4enc.run.pipeline import run_encode

    transform = Engine.transform

    def fails_on_one(self, pixels):
        if pixels.shape[1] == SIZES[2][0]:
            raise RuntimeError("CUDA out of memory (simulated)")
        return transform(self, pixels)

    monkeypatch.setattr(Engine, "transform", fails_on_one)
    tables = {}
    for placement in ("host", "device"):
        out = tmp_path / f"{placement}.parquet"
        run_encode(EncodeOptions(inputs=[str(Path(paths[0]).parent)], out=str(out),
                                 weights=str(tiny_ckpt), device="cpu", dtype="float32",
                                 workers=0, progress=False, transform=placement))
        tables[placement] = pq.read_table(out).to_pylist()
    failed = [row for row in tables["device"] if row["error"]]
    assert len(failed) == 1 and "out of memory" in failed[0]["error"]
    assert failed[0]["path"] == Path(paths[2]).name
    assert ([row for row in tables["device"] if not row["error"]]
            == [row for row in tables["host"] if row["path"] != failed[0]["path"]])
