"""Importing dsv4enc and using ``Encoder`` change no process-wide setting: the allocator
(glibc ``mallopt``), loggers' levels, Pillow's pixel limit and the warnings filters stay as
the program set them. Only the command line makes such settings (``dsv4enc.process``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import CONFIGS, REPO_ROOT

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
