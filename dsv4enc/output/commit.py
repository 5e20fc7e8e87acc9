"""The part writer: commits a run's finished parts on background threads."""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

from ..images.headers import inputs_digest
from ..pausepoints import pause
from .parts import (PartStore, Row, StreamingAssembler, kept_columns, kept_fields,
                    rows_per_group, rows_to_table)

if TYPE_CHECKING:
    from .appending import AppendingStore


class PartWriter:
    """Commits parts on background threads (Parquet encoding releases the GIL) so the device
    never waits for Parquet. Consecutive finished segments are joined into one part, committed
    when the plan's part ends or ``store.commit_seconds`` have passed since the last commit (a
    kill loses about that much work); without them each segment is a part."""

    def __init__(self, store: PartStore, schema, threads: int = 1,
                 assembler: StreamingAssembler | AppendingStore | None = None) -> None:
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
        self._rows: list[Row] = []  # the part being joined: its segments' rows so far
        self._name, self._start, self._end = "", 0, 0
        self._since = time.monotonic()  # the last commit (or the start)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue
            began = time.perf_counter()
            try:
                if len(job) == 2:  # a part another process wrote: (name, entry)
                    name, entry = job
                    start, end = entry["start"], entry["end"]
                    self.store.commit_written(name, entry)
                else:
                    name, rows, start, end, digest = job
                    table = rows_to_table(rows, self.schema, self._kept(start, end, rows))
                    group_rows = rows_per_group(self.schema, rows)
                    del job, rows  # the table holds what it needs of them: let the rest go
                    self.store.commit(name, table, group_rows, start, end, digest)
                if self.assembler is not None:  # a StreamingAssembler copies the part
                    self.assembler.notify()
                pause("commit", name=name, start=start, end=end)
            except BaseException as exc:  # re-raised on the main thread
                self.error = exc
            with self._lock:
                self.seconds += time.perf_counter() - began

    def put(self, name: str, rows: list[Row], start: int, end: int, digest: str, *,
            closes: bool) -> None:
        """A finished segment (or, under --shard-output, a whole part); ``closes``: it ends
        its part (what was joined is committed now)."""
        self.check()
        if self.store.commit_seconds is None:
            self._queue.put((name, rows, start, end, digest))
            return
        if self._rows and start != self._end:
            self._flush()
        if not self._rows:
            self._name, self._start = name, start
        self._rows.extend(rows)
        self._end = end
        if closes or time.monotonic() - self._since >= self.store.commit_seconds:
            self._flush()

    def put_written(self, name: str, entry: dict) -> None:
        """A whole part whose file its encoder wrote (``parts.write_part``'s ``entry``):
        committed in the order handed over, as ``PartStore.commit_written`` does."""
        self.check()
        self._queue.put((name, entry))

    def _flush(self) -> None:
        """Commit the joined segments as one part (named after its first segment)."""
        if self._rows:
            job = (self._name, self._rows, self._start, self._end,
                   inputs_digest(self.store.source[self._start:self._end]))
            self._rows = []
            self._queue.put(job)
        self._since = time.monotonic()

    def _kept(self, start: int, end: int, rows: list[Row]) -> dict | None:
        """The kept table columns of ``rows``, of inputs ``[start, end)`` (all of them, or a
        --shard-output rank's share) (None when the schema has none), read from the input
        tables (a carried row's table is unchanged: its old values)."""
        if not kept_fields(self.schema):  # no input items to gather
            return None
        items = {p.item.key: p.item for p in self.store.source[start:end]}
        return kept_columns(self.schema, [items[row.path] for row in rows])

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Commit what was handed over (an interrupted run keeps its finished segments)."""
        if self.error is None:
            self._flush()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self.check()
        self.store.compact()
