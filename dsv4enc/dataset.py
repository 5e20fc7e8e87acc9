"""Training from an output (docs/training.md): torch datasets over its rows, local or at a
URL, and ``collate_embeddings``, which pads rows of different lengths into one batch.
Locally the files are memory-mapped; at a URL (``s3://``, ``gs://``, fsspec) only the row
groups read are fetched, by ranged reads."""

from __future__ import annotations

import bisect
import copy
import heapq
import numbers
import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from . import storage
from .errors import UsageError, check_flag, check_positive
from .output.read import (BATCH_BYTES, OWN_BATCH_BYTES, OutputFiles, column_names,
                          embedding_format, embedding_views, owned_copy, readable_output,
                          sole_row_array, valid_mask)

__all__ = ["EmbeddingDataset", "EmbeddingIterableDataset", "collate_embeddings"]

#: The columns of every item (``columns`` adds to them).
ITEM_COLUMNS = ("path", "grid_h", "grid_w", "embedding")
#: Row groups a map-style dataset keeps read (each holds a few rows of a real-width output).
CACHED_GROUPS = 2
#: Part files a reader keeps open at most (locally, each memory-mapped): the others are
#: opened again when read, their footers kept from the first open, so that an output of any
#: number of parts stays within the process's open-file limit.
OPEN_FILES = 8


class _Rows:
    """An output's row groups, in order: where each starts among all rows, and the reading of
    one (the columns of an item, the failed rows dropped or kept). At most ``OPEN_FILES``
    files are open at a time, the last read; one opened again reads no footer, its own kept
    (``footers``). A DataLoader worker opens the files again, on a file system of its own:
    it is pickled without them, or forked."""

    def __init__(self, location: str | os.PathLike, columns: Sequence[str], errors: str,
                 storage_options: Any) -> None:
        if errors not in ("skip", "include"):
            raise ValueError(f"errors must be 'skip' or 'include', not {errors!r}")
        self.columns = list(dict.fromkeys([*ITEM_COLUMNS, *column_names(columns), "error"]))
        self.found: OutputFiles = readable_output(location, storage_options)
        self.options = storage_options
        self.pid = os.getpid()
        self.skip = errors == "skip"
        self.groups: list[tuple[int, int]] = []  # (file, row group) in output order
        self.footers: list[Any] = []  # each file's footer, read at its first open
        sizes = []
        for file in range(len(self.found.paths)):
            meta = self.handle(file).metadata
            self.footers.append(meta)
            for group in range(meta.num_row_groups):
                self.groups.append((file, group))
                sizes.append(meta.row_group(group).num_rows)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": OrderedDict(), "pid": None}

    def handle(self, file: int):
        """File ``file``'s ``pyarrow.parquet.ParquetFile``: kept open, or opened (and the
        least recently read closed beyond ``OPEN_FILES``)."""
        if self.pid != os.getpid():  # a forked DataLoader worker: a file system of its own
            fs, _ = storage.locate(self.found.location, self.options)
            self.found, self.pid = replace(self.found, fs=fs), os.getpid()
            self._handles = OrderedDict()  # the parent's, shared by the fork: left open
        handles = self.__dict__.setdefault("_handles", OrderedDict())
        if file in handles:
            handles.move_to_end(file)
            return handles[file]
        path = self.found.paths[file]
        if file < len(self.footers):  # read before: its footer kept, its size the listed one
            handle = self.found.open(path, self.footers[file], self.found.sizes[file])
        else:
            handle = self.found.open(path)
            missing = [c for c in self.columns if c not in handle.schema_arrow.names]
            try:
                if missing:
                    raise UsageError(f"{self.found.name(path)}: no column {missing[0]!r}")
                # checked here, as the dataset is made: refused in the training process, not
                # later inside a DataLoader worker
                embedding_format(handle.schema_arrow, self.found.name(path))
            except UsageError:
                handle.close(force=True)
                raise
        handles[file] = handle
        while len(handles) > OPEN_FILES:
            handles.popitem(last=False)[1].close(force=True)
        return handle

    def read(self, unit: int, columns: Sequence[str]):
        """The ``columns`` of row group ``unit``, as an Arrow table."""
        file, group = self.groups[unit]
        return self.handle(file).read_row_group(group, columns=list(columns))

    def kept(self, table) -> np.ndarray:
        """The positions in a group's table of the rows an item is made of."""
        if not self.skip:
            return np.arange(table.num_rows)
        return np.flatnonzero(~valid_mask(table.column("error").combine_chunks()))

    def group_items(self, unit: int) -> list[dict]:
        """Every row of row group ``unit`` as an item (a failed row's ``embedding`` None, its
        ``error`` kept), each embedding its own: read a batch at a time, a large row alone in
        its batch, whose decoded buffer is handed over rather than copied."""
        file, group = self.groups[unit]
        handle = self.handle(file)
        items: list[dict] = []
        for batch in handle.iter_batches(batch_size=_batch_rows(handle, group),
                                         row_groups=[group], columns=self.columns):
            items.extend(self._items(batch))
        return items

    def _items(self, batch) -> Iterator[dict]:
        column = batch.column("embedding")
        fmt = embedding_format(batch.schema)
        views = embedding_views(column, fmt)
        handed = sole_row_array(column, views[0]) if len(views) == 1 else None
        plain = {n: batch.column(n).to_pylist() for n in self.columns if n != "embedding"}
        blank = np.zeros((fmt.width,) if fmt.pooled else (0, fmt.width), fmt.numpy_dtype)
        blank.flags.writeable = False  # one, shared by the batch's failed items
        for row, view in enumerate(views):
            item = {n: values[row] for n, values in plain.items()}
            if view is None:  # failed: it says the output's width and dtype to the collate
                item = FailedItem(item, blank)
            own = handed if handed is not None else None if view is None else owned_copy(view)
            item["embedding"] = None if own is None else torch.from_numpy(own)
            yield item

    def finish(self, item: dict) -> dict | None:
        """``item`` as the datasets give it: None for a failed row that is skipped; its
        ``error`` only where failed rows are kept."""
        if self.skip:
            return None if item.pop("error") is not None else item
        return item


class FailedItem(dict):
    """The item of a failed row (``errors="include"``): a dict like any item, whose
    ``blank`` is an embedding of its output with no vectors (``(0, width)``, or zeros of
    ``(width,)`` when pooled) in the stored dtype. Its ``embedding`` is None, so this is how
    ``collate_embeddings`` knows the width and dtype of a batch in which every row failed."""

    def __init__(self, values: dict, blank: np.ndarray) -> None:
        super().__init__(values)
        self.blank = blank


def _batch_rows(handle, group: int) -> int:
    """Rows per batch that hold about ``BATCH_BYTES`` of embeddings in row group ``group``;
    one where a row holds ``OWN_BATCH_BYTES`` (its buffer is then handed over)."""
    meta = handle.metadata.row_group(group)
    stored = sum(meta.column(i).total_uncompressed_size for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema.split(".")[0] == "embedding")
    per_row = stored / max(meta.num_rows, 1)
    if per_row >= OWN_BATCH_BYTES:
        return 1
    return max(1, int(BATCH_BYTES // max(per_row, 1)))


class EmbeddingDataset(Dataset):
    """Map-style: ``dataset[i]`` is the i-th row of the output, ``dataset["key"]`` the row
    whose ``path`` is ``key`` (failed rows skipped unless ``errors="include"``). Each read
    takes the row's whole row group; the last ``CACHED_GROUPS`` are kept, so neighbouring
    indices cost one read (and a copy of the row)."""

    def __init__(self, location: str | os.PathLike, columns: Sequence[str] = (), *,
                 errors: str = "skip", storage_options: Any = None) -> None:
        self._rows = _Rows(location, columns, errors, storage_options)
        self._index = self._positions()  # each item's row among all of the output's rows
        self._keys: dict[str, int] | None = None
        self._cache: OrderedDict[int, Any] = OrderedDict()

    def _positions(self) -> np.ndarray:
        rows = self._rows
        if not rows.skip:
            return np.arange(rows.starts[-1], dtype=np.int64)
        kept = [rows.starts[unit] + rows.kept(rows.read(unit, ["error"]))
                for unit in range(len(rows.groups))]
        return np.concatenate(kept).astype(np.int64) if kept else np.zeros(0, np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": OrderedDict()}

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int | str) -> dict:
        position = self._index[self.index_of(index) if isinstance(index, str) else index]
        unit = bisect.bisect_right(self._rows.starts, position) - 1
        kept = self._group(unit)[int(position - self._rows.starts[unit])]
        item = copy.copy(kept)  # the cached row stays as read: the caller gets a copy
        if item["embedding"] is not None:
            item["embedding"] = torch.from_numpy(item["embedding"].numpy().copy())
        return self._rows.finish(item)

    def index_of(self, key: str) -> int:
        """The index of the row whose ``path`` is ``key`` (a KeyError if there is none, or
        if its image failed and failed rows are skipped)."""
        if self._keys is None:
            paths = [path for unit in range(len(self._rows.groups))
                     for path in self._rows.read(unit, ["path"]).column("path").to_pylist()]
            self._keys = {paths[position]: i for i, position in enumerate(self._index.tolist())}
        return self._keys[key]

    def _group(self, unit: int):
        if unit in self._cache:
            self._cache.move_to_end(unit)
        else:
            self._cache[unit] = self._rows.group_items(unit)
            while len(self._cache) > CACHED_GROUPS:
                self._cache.popitem(last=False)
        return self._cache[unit]


class EmbeddingIterableDataset(IterableDataset):
    """The rows of an output, split by row group between the ranks (``rank``/``world_size``;
    default: ``torch.distributed``'s, else one rank) and their DataLoader workers: every row
    exactly once an epoch, in an order drawn from ``seed`` and the epoch (``set_epoch``) when
    ``shuffle``: both non-negative integers (numpy's seeds), a negative one refused where it
    is given rather than when iteration starts. One row group is in memory at a time."""

    def __init__(self, location: str | os.PathLike, columns: Sequence[str] = (), *,
                 errors: str = "skip", shuffle: bool = False, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 storage_options: Any = None) -> None:
        if (rank is None) != (world_size is None):  # one alone would split nothing
            raise ValueError("give rank and world_size together, or neither")
        if world_size is not None:  # refused here, not in a DataLoader worker as it reads
            check_positive("world_size", world_size)
            _check_rank(rank, world_size)
        check_flag("shuffle", shuffle)  # "no" is truthy
        self._rows = _Rows(location, columns, errors, storage_options)
        self.shuffle, self.seed = shuffle, _seed_part("seed", seed)
        # in shared memory: persistent DataLoader workers, copied at the first epoch, see it
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.rank, self.world_size = rank, world_size

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order ``shuffle`` draws (call it before each epoch's loop); a
        non-negative integer, as ``seed``."""
        self._epoch.fill_(_seed_part("epoch", epoch))

    def __getstate__(self) -> dict:
        """The dataset as a DataLoader worker started by spawn or forkserver receives it: a
        new interpreter with no process group, which would read as rank 0 of 1 (every rank's
        workers then reading every row); it carries the rank of the process that sends it."""
        state = dict(self.__dict__)
        if _process_group():
            state["_sender"] = (torch.distributed.get_rank(),
                                torch.distributed.get_world_size())
        return state

    def _ranks(self) -> tuple[int, int]:
        """This process's rank and world size: as given, else its process group's, else
        (a spawned DataLoader worker) those of the process that sent the dataset, else 0
        of 1."""
        if self.rank is not None and self.world_size is not None:
            return self.rank, self.world_size
        if _process_group():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return self.__dict__.get("_sender") or (0, 1)

    def _share(self) -> tuple[int, int]:
        """This reader's slot among all (rank, worker) readers, and their number."""
        rank, world = self._ranks()
        _check_rank(rank, world)
        worker = get_worker_info()
        workers, wid = (1, 0) if worker is None else (worker.num_workers, worker.id)
        return rank * workers + wid, world * workers

    def __iter__(self) -> Iterator[dict]:
        slot, readers = self._share()
        units = np.arange(len(self._rows.groups))
        if self.shuffle:
            units = np.random.default_rng([self.seed, self.epoch]).permutation(units)
        for unit in _deal(units.tolist(), np.diff(self._rows.starts), readers)[slot]:
            items = [item for item in map(self._rows.finish, self._rows.group_items(unit))
                     if item is not None]
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch, unit]).permutation(
                    len(items))
                items = [items[i] for i in order.tolist()]
            yield from items


def _seed_part(name: str, value: int) -> int:
    """``value``, or a ValueError naming ``name`` where numpy would refuse it as a seed (a
    negative number, or not a whole one), so that it is refused where it is given, not when the order is drawn
    (inside a DataLoader worker, in numpy's words)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    return value


def _check_rank(rank: Any, world: int) -> None:
    """A ValueError unless ``rank`` is a whole number from 0 to ``world`` - 1 (0.5 would
    pass a comparison, then fail as a list index while the rows are read)."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not in a world of {world}")


def _process_group() -> bool:
    """Whether this process has joined a ``torch.distributed`` process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _deal(units: list[int], rows: np.ndarray, readers: int) -> list[list[int]]:
    """``units`` (row groups, in order) dealt to ``readers``: each to the one with the fewest
    rows so far (the lowest slot first), so that shares differ by at most one group's rows.
    Every reader deals the same, so each unit goes to exactly one."""
    shares: list[list[int]] = [[] for _ in range(readers)]
    heap = [(0, slot) for slot in range(readers)]
    for unit in units:
        held, slot = heapq.heappop(heap)
        shares[slot].append(unit)
        heapq.heappush(heap, (held + int(rows[unit]), slot))
    return shares


def collate_embeddings(items: Sequence[dict]) -> dict[str, Any]:
    """A batch of items of different lengths: ``embedding`` (batch, longest, width) padded with
    zeros, ``mask`` (batch, longest; True on a row's own vectors) and ``lengths`` (batch,); a
    pooled output's vectors stacked to (batch, width). Other keys: lists, one value per item.
    Failed rows (``errors="include"``) are left out of the tensors: ``lengths`` 0; a batch of
    failed rows alone has the same keys and tensors, of no vectors (``(batch, 0, width)``),
    its width and dtype taken from the items (``FailedItem.blank``: an item made by hand, a
    plain dict, says neither, and such a batch's ``embedding`` is None). The batch is filled
    through numpy (a plain copy; torch's half-precision copies on the CPU are several times
    slower)."""
    if not items:
        raise ValueError("an empty batch")
    batch: dict[str, Any] = {key: [item[key] for item in items]
                             for key in items[0] if key != "embedding"}
    embeddings = [None if item["embedding"] is None else item["embedding"].numpy()
                  for item in items]
    sample = next((e for e in embeddings if e is not None),
                  next((i.blank for i in items if isinstance(i, FailedItem)), None))
    if sample is None:
        batch["embedding"] = None
        return batch
    pooled = sample.ndim == 1  # one vector per image
    lengths = np.array([0 if e is None else 1 if pooled else e.shape[0] for e in embeddings])
    shape = (len(items), sample.shape[0]) if pooled else (len(items), int(lengths.max()),
                                                          sample.shape[1])
    padded = np.zeros(shape, dtype=sample.dtype)
    for i, embedding in enumerate(embeddings):
        if embedding is not None:
            padded[i, :len(embedding)] = embedding
    batch["embedding"] = torch.from_numpy(padded)
    batch["lengths"] = torch.from_numpy(lengths)
    if not pooled:
        batch["mask"] = torch.arange(padded.shape[1])[None, :] < batch["lengths"][:, None]
    return batch
