"""Where a run's output goes and how its parts are committed: the ``--out`` checks, the
background part writers, and which parts an interrupted run already finished."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import AlreadyComplete, DsvError, OutputError, UsageError
from .writer import (PartStore, Row, StreamingAssembler, remove_tree, rows_per_group, rows_to_table,
                     write_json_atomic)

if TYPE_CHECKING:
    from .options import EncodeOptions
    from .pipeline import RunSummary
    from .planning import Part

class OutputLayout:
    """Where parts go (a ``.partial`` folder beside a single-file ``--out``, or the ``--out``
    folder itself) and the checks before anything is computed."""

    def __init__(self, out: str, shard_output: bool) -> None:
        self.out = Path(out)
        self.shard_output = shard_output
        self.folder_mode = shard_output or out.endswith(("/", os.sep)) or self.out.is_dir()
        self.parts_dir = self.out if self.folder_mode else self.out.with_name(self.out.name + ".partial")

    def manifest_name(self, dist) -> str:
        """Each rank keeps its own manifest under --shard-output; merged at the end."""
        if self.shard_output and dist is not None:
            return f"_manifest-rank{dist.rank:03d}.json"
        return "_manifest.json"

    def prepare(self, overwrite: bool, resume: bool) -> None:
        out = self.out
        for parent in [out.parent, *out.parent.parents]:
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"cannot write {out}: {parent} is a file, not a folder")
        has_parts = any(self.parts_dir.glob("_manifest*.json"))
        if self.folder_mode and out.exists() and not out.is_dir():
            raise OutputError(f"--out {out} is a file, but a folder output was asked for")
        if self.folder_mode and out.is_dir() and any(out.iterdir()) and not has_parts:
            raise OutputError(f"--out folder {out} is not empty and holds no dsv4enc output; "
                              "choose another path")
        if not resume and not overwrite:
            if not self.folder_mode and out.exists():
                raise OutputError(f"{out} already exists; pass --overwrite to replace it")
            if has_parts and self.folder_mode:
                raise OutputError(f"--out folder {out} already holds dsv4enc output; pass "
                                  "--resume to finish it or --overwrite to replace it")
            if has_parts:
                raise OutputError(f"an unfinished run left {self.parts_dir}; pass --resume to "
                                  "continue it or --overwrite to start over")
        if overwrite and has_parts:
            remove_tree(self.parts_dir)
        if resume and not has_parts and not self.folder_mode and out.is_file():
            raise AlreadyComplete(f"{out} is already complete; nothing to resume "
                                  "(pass --overwrite to encode again)")

    def discard_if_empty(self) -> None:
        """After a failed run, remove a single-file output's parts folder if no part was
        committed to it (committed parts are kept for --resume)."""
        if not self.folder_mode and not any(self.parts_dir.glob("*.parquet")):
            remove_tree(self.parts_dir)

    def create(self) -> None:
        """Make the parts folder (and missing parents) and check it is writable. Called once
        inputs and weights are known good, so a failed start leaves nothing behind."""
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            probe = self.parts_dir / ".dsv4enc-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"cannot write to {self.parts_dir}: {exc.strerror or exc}") from None


def main_then_all(dist, action) -> None:
    """Run ``action`` (an output check) on rank 0 only, then let every rank raise the
    DsvError it raised, so that no rank is left waiting in a collective for a rank 0 that
    gave up (and reports a dead peer instead of the real reason). Also the ranks' barrier."""
    if dist is None:
        action()
        return
    problem = None
    if dist.is_main:
        try:
            action()
        except DsvError as exc:
            problem = exc
    problem = dist.all_gather_object(problem)[0]
    if problem is not None:
        raise problem


class PartWriter:
    """Commits parts on background threads so the device never waits for Parquet.

    Encoding a part's nested float lists is CPU work that releases the GIL, so several
    threads commit parts side by side on machines with cores to spare."""

    def __init__(self, store: PartStore, schema, threads: int = 1,
                 assembler: StreamingAssembler | None = None) -> None:
        self.store = store
        self.schema = schema
        self.assembler = assembler
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=threads)
        self._threads = [threading.Thread(target=self._run, name=f"dsv4enc-writer-{i}",
                                          daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue
            name, rows, start, end, digest = job
            began = time.perf_counter()
            try:
                table = rows_to_table(rows, self.schema)
                group_rows = rows_per_group(self.schema, rows)
                del job, rows  # the table holds a copy: free the rows before the write
                if self.assembler is not None:  # it copies the table while the part is written
                    self.assembler.offer(name, table, group_rows)
                self.store.commit(name, table, group_rows, start, end, digest)
                if self.assembler is not None:
                    self.assembler.notify()
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc
            with self._lock:
                self.seconds += time.perf_counter() - began

    def put(self, name: str, rows: list[Row], start: int, end: int, digest: str) -> None:
        self.check()
        self._queue.put((name, rows, start, end, digest))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.check()


def resume_filter(store: PartStore, parts: list[Part], opts: EncodeOptions,
                   is_writer_rank: bool, dist, summary: RunSummary) -> list[Part]:
    """Parts still to encode; with ``--resume``, check settings and skip committed parts.

    Under DP-gathered or TP runs rank 0 owns the manifest and tells the other ranks. Under
    --shard-output each rank has its own, but all ranks must walk the same parts (every batch
    ends in collectives): a range is redone by all when any rank lacks its part. A problem
    on any rank stops every rank."""
    shared = dist is not None and not opts.shard_output
    todo_names, problem = None, None
    if is_writer_rank:
        try:
            todo_names = _uncommitted(store, parts, opts)
        except DsvError as exc:
            problem = exc
    if shared:
        todo_names, problem = dist.all_gather_object((todo_names, problem))[0]
    elif dist is not None:
        mine = set(todo_names or ())
        everyone = dist.all_gather_object(
            ([(p.start, p.end) for p in parts if p.name in mine], problem))
        problem = next((exc for _, exc in everyone if exc is not None), None)
        ranges = {r for todo_ranges, _ in everyone for r in todo_ranges}
        todo_names = [p.name for p in parts if (p.start, p.end) in ranges]
    if problem is not None:
        raise problem
    names = set(todo_names)
    todo = [p for p in parts if p.name in names]
    summary.reused = sum(p.end - p.start for p in parts if p.name not in names)
    return todo


def _uncommitted(store: PartStore, parts: list[Part], opts: EncodeOptions) -> list[str]:
    if not opts.resume or not store.manifest_path.is_file():
        store.create()
        return [p.name for p in parts]
    previous = store.load_existing()
    for key, value in store.settings.items():
        if previous.get(key) != value:
            shown = "weights" if key == "weights_fingerprint" else key.replace("_", " ")
            raise UsageError(f"cannot resume: {shown} differs from the interrupted run "
                             f"({previous.get(key)!r} then, {value!r} now); "
                             "use --overwrite to start over")
    store.save()
    return [p.name for p in parts if not store.committed(p.name, p.start, p.end, p.digest)]


def merge_manifests(dist, store: PartStore) -> None:
    """--shard-output: rank 0 lists every rank's parts in one manifest."""
    everything = dist.all_gather_object(store.parts)
    if dist.is_main:
        merged = {name: part for parts in everything for name, part in parts.items()}
        write_json_atomic({"settings": store.settings, "parts": merged},
                          store.folder / "_manifest.json")
