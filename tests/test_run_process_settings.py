"""Importing dsv4enc and using ``Encoder`` change no process-wide setting: the allocator
(glibc ``mallopt``), loggers' levels, Pillow's pixel limit and the warnings filters stay as
the program set them. Only the command line makes such settings (``dsv4enc.process``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers import CONFIGS, REPO_ROOT, write_image

# Runs in a fresh interpreter: other tests in this process run the command line in-process.
SCRIPT = textwrap.dedent("""
    import ctypes, logging, warnings

    calls = []
    real_cdll = ctypes.CDLL

    class Recording:
        def __init__(self, lib):
            self._lib = lib
        def __getattr__(self, name):
            calls.append(name)
            return getattr(self._lib, name)

    ctypes.CDLL = lambda *args, **kwargs: Recording(real_cdll(*args, **kwargs))

    import numpy as np
    import torch  # its own import sets a logger level and warnings filters
    from PIL import Image

    def state():
        names = ["torch.nn.attention.varlen", "huggingface_hub", "torch", "dsv4enc"]
        return ([logging.getLogger(n).level for n in names], Image.MAX_IMAGE_PIXELS,
                list(warnings.filters))

    before = state()
    import dsv4enc
    from dsv4enc import Encoder

    enc = Encoder.from_config({config!r}, device="cpu", dtype="float32")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40 + 9 * i, 56, 3), dtype=np.uint8) for i in range(3)]
    enc.encode(images)
    list(enc.encode_iter(images, pool="mean", features="vit"))
    assert state() == before, (before, state())
    assert "mallopt" not in calls, calls
    print("unchanged")
""")


def test_encoder_changes_no_process_wide_setting():
    script = SCRIPT.format(config=str(CONFIGS / "tiny.json"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("unchanged")


THREADS_SCRIPT = textwrap.dedent("""
    import torch
    from dsv4enc.process import CUDA_HOST_THREADS, own_process_settings

    torch.set_num_threads(8)
    own_process_settings(torch.device("cpu"))
    cpu = torch.get_num_threads()
    own_process_settings(torch.device("cuda"))  # only settings: no CUDA device is touched
    print(cpu, torch.get_num_threads(), CUDA_HOST_THREADS)
""")


def _threads_after_settings(env: dict) -> list[int]:
    import os

    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    done = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, check=True)
    return [int(v) for v in done.stdout.split()]


def test_a_gpu_run_keeps_few_torch_threads_in_its_main_process():
    # A GPU run's main process only copies on the CPU: a thread per core would spin beside
    # the decode workers. A CPU run keeps its threads (the model runs there).
    cpu, cuda, cap = _threads_after_settings({"OMP_NUM_THREADS": None})
    assert (cpu, cuda) == (8, cap)


def test_omp_num_threads_overrides_the_gpu_run_thread_cap():
    cpu, cuda, _ = _threads_after_settings({"OMP_NUM_THREADS": "3"})
    assert (cpu, cuda) == (8, 8)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat_file:
        return int(stat_file.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, /proc")
def test_a_decode_worker_keeps_its_image_buffers_mapped(tmp_path):
    """A worker decoding 1024x768 photos one after another faults in almost no fresh memory
    per image once its heap has grown. With glibc's defaults it returned each image's
    buffers (decoded, resized, padded, in patch order) and faulted them back in: over 2000
    page faults, 7-8 ms of kernel time, per photo."""
    from dsv4enc.tower.config import VisionConfig
    from dsv4enc.images.decode import DecodePool

    cfg = VisionConfig.from_file(CONFIGS / "deepseek-v4-flash.json")
    paths = [str(write_image(tmp_path / f"{i}.jpg", (1024, 768), seed=i)) for i in range(12)]
    with DecodePool(cfg, 1, timeout_s=60.0) as pool:
        pid = pool.workers[0].proc.pid
        # Each result is dropped at once, so its shared-memory slot is reused: the faults
        # counted are the worker's own heap's.
        errors = [r.error for _, r in pool.imap(list(enumerate(paths[:4])), window=1)]
        before = _minor_faults(pid)
        errors += [r.error for _, r in pool.imap(list(enumerate(paths[4:])), window=1)]
        per_image = (_minor_faults(pid) - before) / (len(paths) - 4)
    assert errors == [None] * len(paths)
    assert per_image < 300, f"{per_image:.0f} page faults per image"
