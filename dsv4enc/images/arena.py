"""Shared memory for decoded patches (``PatchArena``), which ``decode.DecodePool`` owns and
hands a slot of to each task."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref

import numpy as np

from ..tower.config import VisionConfig


def patch_slot_bytes(cfg: VisionConfig) -> int:
    """Bytes of the largest transformed image's patches (bfloat16 bits): one arena slot."""
    from ..tower.transform import max_image_tokens

    return max_image_tokens(cfg) * 3 * cfg.patch_size ** 2 * 2


class PatchArena:
    """Shared memory that decode workers write patches into, not pickled through a pipe (a cost
    measured in benchmarks/RESULTS.md): one anonymous memory file (Linux ``memfd``) of
    ``slots`` equal slots, mapped by the pool and by each worker (``WorkerArena``). Nameless, it
    cannot leak: the kernel frees it with the last process that holds it; its pages are
    committed when first written (slots cost address space, not memory). Each task takes a free
    slot; the pool hands on an array over it (``lease``), free again once that array and its
    views are gone. With no free slot, or an image larger than one, patches go through the pipe."""

    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.fd, self.slots, self.slot_bytes = fd, slots, slot_bytes
        self._map: mmap.mmap | None = mmap.mmap(fd, slots * slot_bytes)
        self._free = list(range(slots - 1, -1, -1))  # a stack: reuse pages already in memory
        self._lock = threading.Lock()

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> "PatchArena | None":
        """A new arena, or None where there is no memfd (not Linux) or it cannot be made."""
        if slots <= 0 or slot_bytes <= 0 or not hasattr(os, "memfd_create"):
            return None
        fd = None
        try:
            fd = os.memfd_create("dsv4enc-patches", os.MFD_CLOEXEC)
            os.ftruncate(fd, slots * slot_bytes)
            return cls(fd, slots, slot_bytes)
        except (OSError, ValueError):
            if fd is not None:
                os.close(fd)
            return None

    @property
    def free(self) -> int:
        """Slots neither dispatched nor leased."""
        return len(self._free)

    def take(self) -> int | None:
        """A free slot for the next task, or None (all in use, or the arena is closed)."""
        with self._lock:
            return self._free.pop() if self._free and self._map is not None else None

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def lease(self, slot: int, shape: tuple[int, ...], dtype=np.uint16) -> np.ndarray:
        """What a worker wrote in ``slot`` (uint16 patches, or uint8 pixels), as an array over
        the slot (no copy); the slot is given back when the array and all views of it are gone."""
        flat = np.frombuffer(self._map, dtype, count=int(np.prod(shape)),
                             offset=slot * self.slot_bytes)
        # Views of ``flat`` (reshapes, dtype views, torch.from_numpy) all keep ``flat``
        # itself alive: numpy stops collapsing a view's base at an array over a foreign
        # buffer. So this runs only when the last of them is gone.
        weakref.finalize(flat, self.give_back, slot)
        return flat.reshape(shape)

    def __reduce__(self):
        from multiprocessing import reduction

        # Only while a process is being spawned: ``DupFd`` passes the descriptor to it.
        return WorkerArena.attach, (reduction.DupFd(self.fd), self.slots, self.slot_bytes)

    def close(self) -> None:
        """Unmap (once the leases, which keep the mapping, are gone) and close the memory file."""
        with self._lock:
            if self._map is None:
                return
            mapping, self._map = self._map, None
            self._free.clear()
        with contextlib.suppress(BufferError):  # leases in use: it goes with the last of them
            mapping.close()
        os.close(self.fd)


class WorkerArena:
    """A worker's mapping of the pool's PatchArena."""

    def __init__(self, mapping: mmap.mmap, slot_bytes: int) -> None:
        self.mapping, self.slot_bytes = mapping, slot_bytes

    @classmethod
    def attach(cls, dup_fd, slots: int, slot_bytes: int) -> "WorkerArena | None":
        """The mapping, or None (the worker then sends its patches through the pipe)."""
        fd = dup_fd.detach()
        try:
            return cls(mmap.mmap(fd, slots * slot_bytes), slot_bytes)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping keeps the memory file

    def writer(self, slot: int | None):
        """``out`` for ``transform.image_to_patch_bits`` (and ``decode.decode_image``'s pixels):
        an array of ``shape`` and ``dtype`` over ``slot`` when it fits. Its ``used`` says whether
        it was handed out."""
        def out(shape: tuple[int, ...], dtype=np.uint16) -> np.ndarray | None:
            count = int(np.prod(shape))
            if slot is None or count * np.dtype(dtype).itemsize > self.slot_bytes:
                return None
            out.used = True
            return np.frombuffer(self.mapping, dtype, count=count,
                                 offset=slot * self.slot_bytes).reshape(shape)
        out.used = False
        return out


def default_slots(workers: int) -> int:
    """PatchArena slots of a pool: the default look-ahead (``options.decode_window``) and one
    more per worker, plus the largest batch a consumer holds (``--max-images``'s default)."""
    return 5 * workers + 2 * 64
