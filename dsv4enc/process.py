"""Process-wide settings, made only in processes dsv4enc owns: the command line (each
torchrun rank) and the benchmark. The library (``Encoder``, ``run_encode``) never makes them:
a program that imports dsv4enc keeps its allocator and its loggers as it set them.

(Pillow's settings for owned processes, decode workers included, are
``decode.own_process_pillow_settings``.)
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

_heap_tuned = False


def own_process_settings(device: torch.device) -> None:
    """The settings the command line makes once it knows its device."""
    # torch's varlen_attn logs one INFO line per call (32 per batch): keep logs readable.
    logging.getLogger("torch.nn.attention.varlen").setLevel(logging.WARNING)
    keep_freed_memory_mapped()  # CUDA runs too: their host side allocates MBs per image
    if device.type == "cuda":
        host_torch_single_threaded()


def host_torch_single_threaded() -> None:
    """One torch intra-op thread in a process whose model runs on a GPU.

    Its CPU tensor work is small (positions, merge plans, staging copies of a few hundred
    KB), but each op over 32K elements wakes the other intra-op threads, which then spin
    waiting for more: 1.6 ms of CPU per image in ``bench --host`` at real dims, taken from
    the decode workers that need every other core (benchmarks/RESULTS.md). The patches,
    the large copy, are packed by numpy (``packing.concat_patches``)."""
    torch.set_num_threads(1)


def keep_freed_memory_mapped() -> None:
    """On glibc, serve large CPU tensors from the heap and never trim it back to the OS.

    By default every tensor above a few MB is a fresh mmap that the kernel faults in (and
    zeroes) page by page, and freed heap tops are returned to the OS. A CPU forward allocates
    and frees dozens of such tensors per layer, so the page faults alone cost several percent
    of the forward; the host side of any run (decoded patches off the workers' pipes, packed
    batches, staging copies, rows, Parquet buffers) allocates tens of MB per image, and
    faulting them in was a fifth of its CPU time (benchmarks/RESULTS.md, ``bench --host``).
    The price is that peak memory stays mapped for the life of the process, which is how an
    encoder runs anyway.
    """
    global _heap_tuned
    if _heap_tuned or not sys.platform.startswith("linux"):
        return
    _heap_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)
