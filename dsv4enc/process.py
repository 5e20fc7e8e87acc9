"""Process-wide settings, made only in processes dsv4enc owns (the command line, each torchrun
rank, the benchmark), never by the library (``api.Encoder``, ``run_encode``): a program that
imports dsv4enc keeps its allocator, loggers and Pillow (``own_process_pillow_settings``); and
the CPUs this process may run on."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # decode workers import this module and must not import torch
    import torch

_heap_tuned = False

#: torch intra-op threads of a GPU run's main process (unless OMP_NUM_THREADS says otherwise).
#: One: its CPU work is small copies (numpy packs the patches) beside one decode worker per
#: core, and a second OpenMP thread spins after each copy (measured in benchmarks/RESULTS.md).
CUDA_HOST_THREADS = 1


def own_process_settings(device: "torch.device") -> None:
    """The settings the command line makes once it knows its device."""
    import torch

    # torch's varlen_attn logs one INFO line per call (32 per batch): keep logs readable.
    logging.getLogger("torch.nn.attention.varlen").setLevel(logging.WARNING)
    keep_freed_memory_mapped()  # CUDA runs too: their host side allocates MBs per image
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), CUDA_HOST_THREADS))


def keep_freed_memory_mapped(largest_mapped: int = 1 << 30, keep_free: int = (1 << 31) - 1) -> None:
    """On glibc, serve large CPU buffers from the heap and keep freed heap memory mapped, once
    per process: else each buffer above a few MB (per image, on a run's host side and in decode
    workers) is a fresh mmap faulted in and zeroed page by page (benchmarks/RESULTS.md). Up to
    ``largest_mapped`` they come from the heap; beyond ``keep_free``, freed memory at its top goes
    back to the OS. The command line keeps all; a decode worker passes bounds, for huge images."""
    global _heap_tuned
    if _heap_tuned or not sys.platform.startswith("linux"):
        return
    _heap_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, largest_mapped)
    libc.mallopt(m_trim_threshold, keep_free)


def process_age() -> float | None:
    """Seconds since the kernel created this process (imports included), or None (no /proc)."""
    import time

    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # the name may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if age >= 0 else None


def own_process_pillow_settings() -> None:
    """Pillow's process-wide settings, made once in a process dsv4enc owns (the command line,
    a decode worker): its pixel check off (each open applies its own ``max_pixels``), and its
    warnings quiet. They concern metadata or a palette's transparency, never pixels that
    Pillow could not read (those raise): the image is encoded as Pillow decodes it, as
    ``api.Encoder`` and a model server would, and no stray line breaks the progress bar. A
    file cut short raises too, whatever code imported here set (``LOAD_TRUNCATED_IMAGES``, a
    training script's habit, would encode the grey Pillow fills in): an error row."""
    from PIL import Image, ImageFile

    Image.MAX_IMAGE_PIXELS = None
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    warnings.filterwarnings("ignore", module=r"PIL(\.|$)")


def prefer_jemalloc_pool() -> None:
    """Allocate from Arrow's jemalloc pool where there is one: mimalloc (the default) gives each
    new writer thread fresh pages, whose faults slow a short run's end, but it encodes float16
    faster in steady state (benchmarks/RESULTS.md): only the CLI's CPU runs call this."""
    import pyarrow as pa

    with contextlib.suppress(NotImplementedError, pa.ArrowNotImplementedError):
        pa.set_memory_pool(pa.jemalloc_memory_pool())  # not in every build (e.g. Windows)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
