"""Reading images: header probes (size only) and full decodes in worker processes.

Bad files never raise out of here: a probe or decode returns a result with ``error`` set. The
``DecodePool`` gives each image a time limit and replaces a worker that crashes or hangs, so
one pathological file costs one error row, not the run."""

from __future__ import annotations

import contextlib
import errno
import io
import multiprocessing as mp
import os
import queue
import re
import signal
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from typing import Any, Iterable, Iterator

import numpy as np

from .. import storage
from ..process import keep_freed_memory_mapped, own_process_pillow_settings
from ..tower.config import VisionConfig
from ..tower.transform import no_pixels
from .arena import PatchArena, WorkerArena, default_slots, patch_slot_bytes
from .formats import DEFAULT_MAX_PIXELS, image_name, misnamed, open_image
from .sources import HELD, attach_held, held_key, open_item


@dataclass
class Probe:
    """An image's stored size from its header, or why it could not be read."""

    width: int | None = None
    height: int | None = None
    error: str | None = None
    misnamed: str | None = None  # the format it is, when its name says another (a JPEG .png)


@dataclass
class Decoded:
    """A transformed image: patches (n_h*n_w, 3*p*p) as the uint16 bits of bfloat16; or,
    decoded for the transform on the device, its 8-bit ``pixels`` (h, w, c) instead."""

    patches: np.ndarray | None = None
    pixels: np.ndarray | None = None  # uint8 (h, w, c): ``transform.image_pixels``
    n_h: int = 0
    n_w: int = 0
    width: int | None = None  # the stored size; kept on an error after the header
    height: int | None = None
    error: str | None = None
    out_of_memory: bool = False  # the worker's memory bound was hit: it is replaced
    unavailable_since: float | None = None  # a store's outage began (``storage.note_row``)
    slot: int | None = None  # from a worker: the PatchArena slot that holds the patches
    shape: tuple[int, ...] | None = None  # from a worker: the slot holds pixels of this shape


#: Errors that say nothing about the image (a time limit, a crashed or unstarted worker, a
#: stop, a store not answering): a part holding one is encoded again on --resume.
TRANSIENT_ERRORS = ("decode timed out", "header read timed out", "decoder crashed",
                    "decode worker failed", "interrupted before", storage.UNAVAILABLE)
#: Exception types of a read that may succeed later on the same file (it was moved away, a
#: disk or network stalled); ``describe_error`` opens an error row with the type's name.
TRANSIENT_TYPES = frozenset({"FileNotFoundError", "TimeoutError", "ConnectionError",
                             "ConnectionResetError", "ConnectionAbortedError",
                             "BrokenPipeError", "InterruptedError", "BlockingIOError",
                             "PermissionError"})
#: OS error numbers of such reads, for an ``OSError`` row (``[Errno N]``): Pillow raises a
#: bare ``OSError`` without a number for a truncated or corrupt file, which stays permanent.
TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ENOENT", "EIO", "ETIMEDOUT", "EAGAIN", "ESTALE", "EBUSY", "EINTR", "EACCES", "EPERM",
    "ENXIO", "ENODEV", "ENOMEDIUM", "ECONNRESET", "ECONNREFUSED", "EHOSTUNREACH",
    "ENETDOWN", "ENETUNREACH", "EREMOTEIO") if hasattr(errno, name))
_ERROR_TYPE = re.compile(r"(\w+): (?:\[Errno (\d+)\])?")


def is_transient(error: str | None) -> bool:
    """Whether an error row may become an embedding when its unchanged file is read again
    (not found, I/O, time limits, a store or worker failing; ``--update`` encodes it again),
    rather than saying what the file is (corrupt, unsupported, too large: permanent)."""
    if error is None:
        return False
    if error.startswith(TRANSIENT_ERRORS):
        return True
    opened = _ERROR_TYPE.match(error)
    if opened is None:
        return False
    name, number = opened.groups()
    return name in TRANSIENT_TYPES or (number is not None and int(number) in TRANSIENT_ERRNOS)


def describe_error(exc: BaseException) -> str:
    """One line: the exception type and its message."""
    text = " ".join(str(exc).split()) or "no details"
    return f"{type(exc).__name__}: {text}"[:500]


def read_failure(exc: BaseException, source) -> tuple[str, float | None]:
    """An image's error for ``exc``, and when its store's outage began (None: not one): an
    input in a store not answering (``storage.StoreUnavailable``, a read failed on an outage)
    gets a transient ``storage.UNAVAILABLE`` error (encoded again on --resume)."""
    if isinstance(exc, storage.StoreUnavailable):
        return str(exc), exc.since
    outage = storage.read_outage(getattr(source, "path", source), exc)
    return outage if outage is not None else (describe_error(exc), None)


def _readable(source):
    """What PIL opens for ``source``: a path or a file object as is, bytes as a file object,
    an ``items.InputItem`` through ``sources.open_item``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(source)
    if isinstance(source, (str, os.PathLike)) or hasattr(source, "read"):
        return source
    return _readable(open_item(source))


def open_checked(source, max_pixels: int, name: str | None = None):
    """Open ``source`` with Pillow, refusing more than ``max_pixels`` pixels: this call's own
    limit, not the process-wide ``PIL.Image.MAX_IMAGE_PIXELS`` (encoders with other limits may
    run in threads of one process), whose check, still applied first, is refused alike."""
    from PIL import Image

    handle = _readable(source)
    try:  # ``name`` overrides the name of what is opened
        image = open_image(handle, name if name is not None else image_name(source, handle))
    except BaseException as exc:
        if hasattr(handle, "close"):
            handle.close()
        if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
            # Pillow's message quotes its own limit (twice its setting, for the error).
            raise ValueError(f"image has more pixels than --max-pixels {max_pixels} or "
                             f"Pillow's Image.MAX_IMAGE_PIXELS allow (possible decompression "
                             f"bomb): {exc}") from None
        raise
    try:
        _check_pixels(image, max_pixels)
    except ValueError:
        image.close()
        raise
    return image


def _check_pixels(image, max_pixels: int) -> None:
    """Refuse an image, or TIFF tiles, of more than ``max_pixels`` pixels (a tile is allocated
    whole: a 150-byte file that declares 16384x16384 tiles costs 256 MB a band)."""
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image has {width}x{height} = {width * height} pixels, more "
                         f"than --max-pixels {max_pixels} (possible decompression bomb)")
    tags = getattr(image, "tag_v2", None) or {}
    tile_w, tile_h = tags.get(322), tags.get(323)  # TileWidth, TileLength
    if isinstance(tile_w, int) and isinstance(tile_h, int) and tile_w * tile_h > max_pixels:
        raise ValueError(f"TIFF declares {tile_w}x{tile_h} tiles = {tile_w * tile_h} pixels each, "
                         f"more than --max-pixels {max_pixels} (possible decompression bomb)")


def regular_only(target: Any) -> Any:
    """``target``, unless a path naming a FIFO or a device (ValueError): its open could block."""
    if isinstance(target, (str, os.PathLike)) and not stat.S_ISREG(os.stat(target).st_mode):
        raise ValueError(storage.NOT_REGULAR)
    return target


def probe_image(source, max_pixels: int = DEFAULT_MAX_PIXELS) -> Probe:
    """The stored size from the header alone (no EXIF rotation) of a path, bytes or an
    ``items.InputItem``. Runs on threads: touches nothing process-wide, and a FIFO or a device
    is an error, not a wait (``headers.probe_all`` bounds its time)."""
    handle = None
    try:
        target = source
        if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
            target = handle = open_item(source, stream=True)  # a plain file item gives its path
        name = image_name(source, target)
        with open_checked(regular_only(target), max_pixels, name=name) as image:
            width, height = image.size
            actual = misnamed(image, name)
        if (error := no_pixels(width, height)) is not None:
            return Probe(error=error)
        return Probe(width=width, height=height, misnamed=actual)
    except Exception as exc:  # an error row, never a crash
        HELD.take(held_key(source))  # never decoded: what its probe read ahead is not kept
        return Probe(error=read_failure(exc, source)[0])
    finally:
        if hasattr(handle, "close"):  # a stream over a container member: ours to close
            handle.close()


def decode_image(source, cfg: VisionConfig, max_pixels: int = DEFAULT_MAX_PIXELS,
                 out=None, pixels: bool = False) -> Decoded:
    """Decode, transform and patchify one image (an animation's first frame) given as for
    ``probe_image``; ``out`` as ``transform.image_to_patch_bits`` takes it. ``pixels``: the
    decoded pixels for the transform on the device, when no larger than a ``PatchArena`` slot
    (a larger photo is transformed here, to the same bytes: what a worker hands on is bounded)."""
    from ..tower.transform import image_pixels, image_to_patch_bits, plan_canvas

    width = height = None  # the stored size, once the header is read
    try:
        with open_checked(source, max_pixels) as image:
            width, height = image.size
            if (error := no_pixels(width, height)) is not None:  # no size, as a probe gives
                return Decoded(error=error)
            canvas = plan_canvas(width, height, cfg)  # no canvas: an error before decoding
            image.load()
            if pixels and width * height * 3 <= patch_slot_bytes(cfg):
                return Decoded(pixels=_into(image_pixels(image), out), n_h=canvas.n_h,
                               n_w=canvas.n_w, width=width, height=height)
            bits, canvas = image_to_patch_bits(image, cfg, out)
        return Decoded(patches=bits, n_h=canvas.n_h, n_w=canvas.n_w, width=width, height=height)
    except MemoryError as exc:  # numpy's and Pillow's allocation failures alike
        return Decoded(error=f"MemoryError: decoding needs more memory than is available "
                       f"({describe_error(exc)})", out_of_memory=True, width=width, height=height)
    except Exception as exc:
        error, since = read_failure(exc, source)
        return Decoded(error=error, unavailable_since=since, width=width, height=height)


def _into(array: np.ndarray, out) -> np.ndarray:
    """``array`` copied into the memory ``out(shape, dtype)`` gives (a worker's arena slot),
    or itself where there is none (a copy if it is read-only: torch takes writable arrays)."""
    target = out(array.shape, array.dtype) if out is not None else None
    if target is None:
        return array if array.flags.writeable else array.copy()
    target[...] = array
    return target


def patches_tensor(decoded: Decoded):
    """The decoded patches as a bfloat16 torch tensor (n_h*n_w, 3*p*p), sharing memory."""
    from ..tower.transform import bf16_bits_to_tensor

    return bf16_bits_to_tensor(decoded.patches)


#: A decode worker's memory bound beyond its start-up footprint: bytes per pixel --max-pixels
#: allows (the widest modes, 4 bytes a pixel, with their 8-bit RGB copies fit), plus room for
#: its cache of table row groups and the transform's canvas.
WORKER_BYTES_PER_PIXEL = 16
WORKER_HEADROOM = 768 << 20
_RLIMIT_MAX = (1 << 63) - 1  # the largest limit setrlimit takes (a C long)
# A worker's heap (``_worker_main``): buffers up to 64 MB (a 20-megapixel photo's planes) come
# from it and stay mapped when freed, up to 512 MB; larger ones are mapped and given back.
WORKER_HEAP_LARGEST = 64 << 20
WORKER_HEAP_KEEP = 512 << 20


def _limit_memory(budget: int | None) -> None:
    """Cap this process's data segment at its current size plus ``budget``: past it, an
    allocation raises MemoryError (that image's error row). Linux only; a limit past what
    ``setrlimit`` takes (a C long) is none at all."""
    if budget is None:
        return
    with contextlib.suppress(ImportError, OSError, StopIteration, ValueError, OverflowError):
        import resource

        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status
                        if line.startswith("VmData:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = used + budget if hard == resource.RLIM_INFINITY else min(used + budget, hard)
        if limit > _RLIMIT_MAX:
            return
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _exit_with_parent() -> None:
    """End this worker when its parent dies (SIGKILL, OOM killer), even in a long decode."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="dsv4enc-parent-watch", daemon=True).start()


def _worker_main(conn, cfg: VisionConfig, max_pixels: int,
                 memory_budget: int | None = None, arena: WorkerArena | None = None,
                 pixels: bool = False) -> None:
    # Ctrl-C reaches the whole process group: the parent decides when to stop (between
    # batches), so a worker must not die with an image in hand.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    own_process_pillow_settings()
    # A photo's buffers (decoded, resized, padded, patch order: 2-3 MB each) are freed and
    # made again for every image; glibc's default returns them to the OS each time, and
    # faulting them back in is a large share of the worker's work (benchmarks/RESULTS.md).
    keep_freed_memory_mapped(largest_mapped=WORKER_HEAP_LARGEST, keep_free=WORKER_HEAP_KEEP)
    _exit_with_parent()
    _limit_memory(memory_budget)
    # A parent gone shows as EOF or OSError: the worker ends (``decode_image`` raises nothing).
    try:
        conn.send(_READY)  # the parent starts an image's clock only once the worker is up
        while (task := conn.recv()) is not None:
            seq, source, slot = task
            out = arena.writer(slot) if arena is not None else None
            result = decode_image(source, cfg, max_pixels, out, pixels)
            if out is not None and out.used and result.error is None:
                # The pool reads them from the slot (pixels by their shape).
                result.shape = None if result.pixels is None else result.pixels.shape
                result.patches, result.pixels, result.slot = None, None, slot
            conn.send((seq, result))
            if result.out_of_memory:
                return  # the parent replaces this worker: a fresh heap for the next image
    except (EOFError, OSError, KeyboardInterrupt):
        return


_END = object()  # the last item an imap pump puts on its queue
_POLL_S = 0.1  # how often a waiting pump thread checks whether it should stop
#: What a task source of ``DecodePool.imap`` yields when its next task is not known yet (a
#: streaming plan's next window): the pump collects and asks again (the source waits first).
NOT_YET = object()
_READY = "ready"  # a worker's first message: imports done, taking images
STARTUP_LIMIT_S = 120.0  # a worker that is not up by then counts as crashed


class _Worker:
    def __init__(self, pool: "DecodePool") -> None:
        self.conn, child = pool._ctx.Pipe(duplex=True)
        self.proc = pool._ctx.Process(target=_worker_main, daemon=True, args=(
            child, pool.cfg, pool.max_pixels, pool.memory_budget, pool.arena, pool.pixels))
        self.proc.start()
        child.close()
        self.spawned = time.monotonic()
        self.ready = False
        # (seq, start time); the start is None until the worker is ready: spawning a process
        # and importing torch can take longer than an image's time limit.
        self.task: tuple[int, float | None] | None = None
        self.slot: int | None = None  # the PatchArena slot of the current task, if any

    def deadline(self, timeout_s: float | None) -> float | None:
        """When the current task counts as hung (None: never)."""
        seq, start = self.task
        if start is None:
            return self.spawned + max(STARTUP_LIMIT_S, timeout_s or 0.0)
        return None if timeout_s is None else start + timeout_s

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class DecodeStream:
    """What ``DecodePool.imap`` returns: an iterator of ``(tag, Decoded)`` in task order.
    ``close()`` (or closing the pool) stops its feeding thread, consumed or not."""

    def __init__(self, pool: "DecodePool", tasks: Iterator, window: int) -> None:
        self._pool, self._results = pool, queue.SimpleQueue()
        self._credits = threading.Semaphore(max(1, window))
        self._stop = threading.Event()
        self._done = False
        self._pump = threading.Thread(target=pool._pump,
                                      args=(tasks, self._results, self._credits, self._stop),
                                      name="dsv4enc-decode", daemon=True)
        pool._streams.append(self)
        self._pump.start()  # not at the first next(): decoding starts while the caller sets up

    def __iter__(self) -> "DecodeStream":
        return self

    def __next__(self) -> tuple[Any, Decoded]:
        while (item := self.next_within(3600.0)) is None:
            pass
        return item

    def next_within(self, timeout_s: float) -> tuple[Any, Decoded] | None:
        """``next``, or None when no result comes within ``timeout_s`` (a caller that polls)."""
        if self._done:
            raise StopIteration
        try:
            item = self._results.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is _END or isinstance(item, BaseException):
            self.close()
            raise StopIteration if item is _END else item
        self._credits.release()
        return item

    def close(self) -> None:
        self._done = True
        self._stop.set()
        if self._pump is not threading.current_thread():
            self._pump.join()
        if self in self._pool._streams:
            self._pool._streams.remove(self)


class DecodePool:
    """Decode images in worker processes, in order, with a bounded look-ahead (``workers=0``:
    inline, untimed); a worker that dies or passes ``timeout_s`` is replaced (an error row)."""

    def __init__(self, cfg: VisionConfig, workers: int, max_pixels: int = DEFAULT_MAX_PIXELS,
                 timeout_s: float | None = None,
                 memory_budget: int | str | None = "auto", slots: int | None = None,
                 pixels: bool = False) -> None:
        """``pixels``: decode for the transform on the device (``decode_image``)."""
        self.cfg, self.max_pixels, self.timeout_s = cfg, max_pixels, timeout_s
        self.pixels, self.n_workers = pixels, workers
        # What a worker may allocate past its start-up footprint ("auto": from max_pixels).
        self.memory_budget = (WORKER_BYTES_PER_PIXEL * max_pixels + WORKER_HEADROOM
                              if memory_budget == "auto" else memory_budget)
        self._ctx = mp.get_context("spawn")  # fork is unsafe after torch/CUDA start threads
        # ``slots``: None for ``default_slots``; 0: none (patches go through the pipes).
        self.arena = (PatchArena.create(default_slots(workers) if slots is None else slots,
                                         patch_slot_bytes(cfg)) if workers > 0 else None)
        self._row_width = 3 * cfg.patch_size ** 2
        # ``arena`` and ``workers`` are public for inspection; only the pool changes them.
        self.workers = [_Worker(self) for _ in range(workers)]
        self.replaced = 0
        self._streams: list[DecodeStream] = []

    def close(self) -> None:
        for stream in list(self._streams):  # an abandoned imap's thread uses the workers
            stream.close()
        HELD.clear()  # inputs read ahead for this run's decode
        for worker in self.workers:
            worker.stop(kill=worker.task is not None)
        self.workers = []
        if self.arena is not None:
            self.arena.close()  # freed once the last lease (a decoded image) is gone

    def __enter__(self) -> "DecodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _replace(self, index: int) -> None:
        old = self.workers[index]
        old.stop(kill=True)  # returns once it is gone: it can no longer write to its slot
        if old.slot is not None:
            self.arena.give_back(old.slot)
        self.workers[index] = _Worker(self)
        self.replaced += 1

    def _received(self, worker: _Worker, result: Decoded) -> Decoded:
        """A worker's result as the consumer gets it: patches written in the task's slot
        become an array over it (a lease); an unused slot is free again."""
        slot, worker.slot = worker.slot, None
        if result.slot is not None and slot == result.slot:
            if result.shape is not None:
                result.pixels = self.arena.lease(slot, result.shape, np.uint8)
            else:
                result.patches = self.arena.lease(slot, (result.n_h * result.n_w,
                                                         self._row_width))
            result.slot = result.shape = None
            return result
        if slot is not None:
            self.arena.give_back(slot)
        if result.slot is not None:  # never sent by a worker of this pool: not to be trusted
            return Decoded(error="decode worker answered with a slot it was not given")
        return result

    def imap(self, tasks: Iterable[tuple[Any, Any]],
             window: int = 64) -> Iterator[tuple[Any, Decoded]]:
        """``(tag, Decoded)`` for each ``(tag, source)`` task (a picklable ``decode_image``
        source; or ``NOT_YET``), in task order. With workers, a ``DecodeStream``, whose thread
        feeds them while the caller is busy, ``window`` tasks ahead at most (bounded memory)."""
        tasks = (task if task is NOT_YET else (task[0], attach_held(task[1])) for task in tasks)
        if not self.workers:
            return ((task[0], decode_image(task[1], self.cfg, self.max_pixels,
                                           pixels=self.pixels))
                    for task in tasks if task is not NOT_YET)
        return DecodeStream(self, iter(tasks), window)

    def _pump(self, source: Iterator, results: queue.SimpleQueue, credits: threading.Semaphore,
              stop: threading.Event) -> None:
        """``imap``'s feeding loop: takes tasks while it holds credits (one per untaken result),
        dispatches, collects, and queues results in order, then ``_END`` (or what stopped it)."""
        waiting: deque[tuple[int, Any]] = deque()
        tags: dict[int, Any] = {}
        done: dict[int, Decoded] = {}
        next_seq = next_out = 0
        exhausted = False
        source_error: Exception | None = None
        try:
            while not stop.is_set():
                while not exhausted and credits.acquire(blocking=False):
                    try:
                        task = next(source, _END)
                    except Exception as exc:  # after the images taken before it
                        task, source_error = _END, exc
                    if task is _END or task is NOT_YET:  # NOT_YET: asked again at the next turn
                        exhausted = task is _END
                        credits.release()
                        break
                    tags[next_seq] = task[0]
                    waiting.append((next_seq, task[1]))
                    next_seq += 1
                self._dispatch(waiting, done)
                while next_out in done:
                    results.put((tags.pop(next_out), done.pop(next_out)))
                    next_out += 1
                if exhausted and next_out == next_seq:
                    results.put(_END if source_error is None else source_error)
                    return
                if any(w.task is not None for w in self.workers):
                    self._collect(done, max_wait=_POLL_S)
                elif credits.acquire(timeout=_POLL_S):  # all credits out: wait for the consumer
                    credits.release()
            # Stopped: a consumer still waiting (from another thread) must not wait forever.
            results.put(RuntimeError("decoding was stopped (the decode pool was closed)"))
        except BaseException as exc:  # handed to the consumer, which raises it
            results.put(exc)

    def _dispatch(self, waiting: deque, done: dict[int, Decoded]) -> None:
        for index, worker in enumerate(self.workers):
            if worker.task is None and waiting:
                seq, path = waiting.popleft()
                worker.slot = self.arena.take() if self.arena is not None else None
                try:
                    worker.conn.send((seq, path, worker.slot))
                    worker.task = (seq, time.monotonic() if worker.ready else None)
                except OSError:
                    done[seq] = Decoded(error="decode worker failed to start this image")
                    self._replace(index)

    def _collect(self, done: dict[int, Decoded], max_wait: float) -> None:
        """Wait up to ``max_wait`` s (less if a deadline comes first) for workers' messages."""
        busy = [(i, w) for i, w in enumerate(self.workers) if w.task is not None]
        deadlines = [d for _, w in busy if (d := w.deadline(self.timeout_s)) is not None]
        timeout = max(0.0, min([max_wait, *(d - time.monotonic() for d in deadlines)]))
        ready = set(wait_ready([w.conn for _, w in busy] + [w.proc.sentinel for _, w in busy],
                               timeout))
        for index, worker in busy:
            seq, start = worker.task
            if worker.conn in ready:
                with contextlib.suppress(EOFError, OSError):
                    message = worker.conn.recv()
                    if message == _READY:
                        worker.ready = True
                        worker.task = (seq, time.monotonic())
                        continue
                    got_seq, result = message
                    done[got_seq] = self._received(worker, result)
                    worker.task = None
                    if result.out_of_memory:
                        self._replace(index)  # it exits: its memory bound was reached
                    continue
            deadline = worker.deadline(self.timeout_s)
            if worker.conn in ready or worker.proc.sentinel in ready or not worker.proc.is_alive():
                worker.proc.join(timeout=1.0)  # its pipe can close before it is reaped
                code = worker.proc.exitcode
                done[seq] = Decoded(error=f"decoder crashed on this image (exit code {code})")
                self._replace(index)
            elif deadline is not None and time.monotonic() > deadline:
                done[seq] = Decoded(error=f"decode timed out after {self.timeout_s:g}s"
                                    if start is not None else "decode worker did not start")
                self._replace(index)
