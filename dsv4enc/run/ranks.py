"""How a run is spread over processes, and the one place that talks to the other ranks.

A ``Topology`` is built once per run from the torchrun context (``dist.DistContext``, or
None for a plain launch): a single process (no collectives); ``gathered`` (data parallel:
each rank encodes its share of every part, rank 0 gathers the rows and writes them);
``sharded`` (``--shard-output``: each rank writes its own share); or tensor parallel (the
tower split over the ranks, rank 0 writes). Every collective of the run goes through it.
This module imports no torch: a plain launch never pays for it."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import DsvError, UsageError

if TYPE_CHECKING:
    from .summary import RunSummary
    from ..output.parts import PartStore


def launched_ranks() -> int:
    """How many ranks torchrun started (1 for a plain launch), from the environment alone:
    for what runs before the process group exists (the listing, signal handling)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launched_rank() -> int:
    """This process's rank as torchrun launched it (0 for a plain launch), from the
    environment alone, as ``launched_ranks``."""
    return int(os.environ.get("RANK", "0") or 0)


class Topology:
    """The run's ranks (see the module's doc). ``dist``: the torchrun context or None."""

    def __init__(self, dist=None, shard_output: bool = False) -> None:
        self.dist = dist
        self.shard_output = shard_output and dist is not None
        self.tensor_parallel = False  # set by ``split_tower``
        self._listed: tuple[int, str] | None = None  # see ``note_listed``

    # -- who does what ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return 0 if self.dist is None else self.dist.rank

    @property
    def world_size(self) -> int:
        return 1 if self.dist is None else self.dist.world_size

    @property
    def is_main(self) -> bool:
        return self.dist is None or self.dist.is_main

    @property
    def writes(self) -> bool:
        """Whether this rank writes parts (rank 0, or every rank under --shard-output)."""
        return self.is_main or self.shard_output

    @property
    def splits_images(self) -> bool:
        """Whether each rank encodes a share of the images (data parallel)."""
        return self.dist is not None and not self.tensor_parallel

    @property
    def gathered(self) -> bool:
        return self.splits_images and not self.shard_output

    @property
    def sharded(self) -> bool:
        return self.splits_images and self.shard_output

    # -- set-up ----------------------------------------------------------------------
    def split_tower(self, model, tp_mode: str) -> None:
        """``--tp-mode weights``: slice ``model`` into this rank's shard (it stays whole, data
        parallel, where the world size does not divide the tower)."""
        if self.dist is not None and tp_mode == "weights":
            from ..tower.tensor_parallel import apply_tensor_parallel

            self.tensor_parallel = apply_tensor_parallel(
                model, self.dist.rank, self.dist.world_size, self.dist.all_reduce_sum)

    # -- collectives -----------------------------------------------------------------
    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (this rank's alone for a single process)."""
        if self.dist is None:
            return [value]
        # Each rank says where it gathers (its caller): ranks whose inputs or options differ
        # fall out of step, and a collective paired with another is refused, not unpickled
        everyone = self.dist.all_gather_object((sys._getframe(1).f_code.co_name, value))
        _in_step([place for place, _ in everyone])
        return [value for _, value in everyone]

    def gather_listed(self, value: Any, start: int, keys: str) -> list[Any]:
        """``gather`` of work on the inputs from ``start`` on whose keys digest to ``keys``:
        ranks that listed other inputs there stop in one line (every rank alike) before any
        uses another's ``value`` (a plan runs ahead of the listings' comparison)."""
        everyone = self.gather(((start, keys), value))
        _same_listing([listed for listed, _ in everyone])
        return [value for _, value in everyone]

    def main_then_all(self, action: Callable[[], None]) -> None:
        """Run ``action`` (an output check) on rank 0 only, then let every rank raise the
        DsvError it raised, so that no rank waits in a collective for a rank 0 that gave up
        (and reports a dead peer instead of the real reason). Also the ranks' barrier."""
        problem = None
        if self.is_main:
            try:
                action()
            except DsvError as exc:
                problem = exc
        problem = self.gather(problem)[0]
        if problem is not None:
            raise problem

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def agree_on_todo(self, todo: list[tuple[int, int]] | None, problem: DsvError | None,
                      ) -> tuple[list[tuple[int, int]] | None, DsvError | None]:
        """Resume agreement: the input ranges every rank encodes, and a problem of any rank.
        One manifest (rank 0's): rank 0 tells the others. One per rank (--shard-output): a
        range is redone by all when any rank lacks its part (every batch ends in
        collectives, so all ranks walk the same parts)."""
        everyone = self.gather((todo, problem, self._listed))
        _same_listing([listed for _, _, listed in everyone])
        if not self.shard_output:
            return everyone[0][:2]
        problem = next((exc for _, exc, _ in everyone if exc is not None), None)
        return sorted({tuple(r) for ranges, _, _ in everyone for r in ranges or ()}), problem

    def note_listed(self, start: int, keys: str) -> None:
        """What this rank listed, for the next ``agree_on_todo``: the part from input ``start``
        with ``keys`` (a digest of its inputs' keys). A rank that listed more or fewer parts
        is out of step at its next gather (``gather``)."""
        self._listed = (start, keys)

    def agree_on_settings(self, settings: dict[str, Any]) -> None:
        """Every rank's ``settings`` (what shapes its rows and plan, by the flag that sets
        each) against rank 0's, in one gather: where any differs, every rank stops with the
        same line naming the first (rows of two towers, or plans that do not pair up)."""
        if self.dist is None:
            return
        ours, *others = self.gather(settings)
        for rank, theirs in enumerate(others, 1):
            for name in {**ours, **theirs}:  # rank 0's names in order, then the rest
                if theirs.get(name) != ours.get(name):
                    raise UsageError(f"rank {rank}'s {name} differs from rank 0's "
                                     f"({theirs.get(name)!r} there, {ours.get(name)!r} "
                                     f"on rank 0): torchrun ranks need the same options")

    def exchange_rows(self, local: dict[int, Any], width: int, pooled: bool,
                      empty_dtype) -> dict[int, Any]:
        """Data parallel: every rank sends its rows; rank 0 gets them all (one padded
        all-gather of the embeddings, one object gather of the rest)."""
        import numpy as np
        import torch

        from .dist import gather_rows
        from ..output.parts import Row

        meta = [(i, {**asdict(r), "embedding": None},
                 0 if r.embedding is None else len(r.embedding)) for i, r in local.items()]
        embeddings = [r.embedding for r in local.values() if r.embedding is not None]
        flat = (torch.from_numpy(np.concatenate([e.reshape(-1, width) for e in embeddings]))
                if embeddings else torch.zeros(0, width, dtype=empty_dtype))
        metas = self.gather(meta)
        counts = [sum(n for _, _, n in m) for m in metas]
        per_rank = gather_rows(self.dist, flat.to(self.dist.device), counts)
        rows: dict[int, Row] = {}
        for rank_meta, block in zip(metas, per_rank):
            pieces = block.cpu().split([n for _, _, n in rank_meta])
            for (index, fields, n), emb in zip(rank_meta, pieces):
                row = Row(**fields)
                if n:
                    row.embedding = (emb.reshape(width) if pooled else emb).numpy()
                rows[index] = row
        return rows

    def merge_manifests(self, store: PartStore, stamps: dict[str, Any]) -> MergedManifest | None:
        """--shard-output: rank 0 lists every rank's parts in one manifest, and returns it
        with every rank's ``stamps`` (its parts' row stamps, by name); the other ranks None.
        Every rank first looks in its own folder for a part of each rank: ranks that wrote
        into different folders (another --out, or one folder per node) all stop, rather than
        rank 0 recording parts it cannot read."""
        everything = self.gather((store.parts, stamps))
        if store.part_folder == store.folder:  # a bucket's parts are not in the folder
            for rank, (parts, _) in enumerate(everything):
                if parts and not (store.folder / next(iter(parts.values()))["file"]).exists():
                    raise UsageError(f"rank {rank}'s parts are not in {store.folder} (another "
                                     f"--out, or a folder the ranks do not share): "
                                     f"--shard-output ranks need one --out folder that "
                                     f"every rank sees")
        if not self.is_main:
            return None
        merged = MergedManifest(  # a rank's ``share`` serves its own --resume alone
            store.folder, store.settings,
            {name: {key: value for key, value in part.items() if key != "share"}
             for parts, _ in everything for name, part in parts.items()},
            {name: rows for _, theirs in everything for name, rows in theirs.items()})
        merged.save()
        return merged

    def sum_rank_counts(self, summary: RunSummary) -> None:
        """--shard-output: each rank counted only its own rows, and the error rows of its own
        shares of the parts that --resume kept; the summary shows them all."""
        everyone = self.gather(summary)
        summary.rank_loads = [float(done.tokens) for done in everyone]
        for rank, done in enumerate(everyone):
            if rank != self.rank:
                summary.add(done, times=False)
                summary.reused_failed += done.reused_failed

    def sum_rank_tokens(self, summary: RunSummary, padded_tokens: int) -> None:
        """Gathered data parallel: count every rank's share of the padding. The real tokens
        are counted with the rows kept, which rank 0 gathered: they are every rank's already."""
        counts = self.gather((padded_tokens, summary.merge_pad_tokens))
        summary.padded_tokens, summary.merge_pad_tokens = map(sum, zip(*counts))


def _in_step(places: list[str]) -> None:
    """Refuse in one line (every rank alike) ranks that gather in different places."""
    for rank, place in enumerate(places[1:], 1):
        if place == places[0]:
            continue
        if "agree_on_todo" in (place, places[0]):  # one rank judged a part the other lacks
            raise UsageError(f"the ranks listed different inputs (rank {rank} listed "
                             f"{'more' if place == 'agree_on_todo' else 'fewer'} parts than "
                             f"rank 0): torchrun ranks need the same inputs (the same "
                             f"folders, lists and --files-from file)")
        # (the places are function names, which no user gave: the line names the ranks)
        raise UsageError(f"the ranks fell out of step (rank {rank} is at another point of "
                         "the run than rank 0): torchrun ranks need the same options and "
                         "inputs")


def _same_listing(everyone: list[tuple[int, str] | None]) -> None:
    """Refuse in one line (every rank alike) ranks that listed different inputs."""
    for rank, listed in enumerate(everyone[1:], 1):
        if listed == everyone[0]:
            continue
        at = min(listed[0], everyone[0][0]) if listed and everyone[0] else 0
        raise UsageError(f"the ranks listed different inputs (rank {rank}'s differ from rank "
                         f"0's from input {at:,} on): torchrun ranks need the same inputs "
                         f"(the same folders, lists and --files-from file)")


@dataclass
class MergedManifest:
    """A sharded output's merged manifest: every rank's parts, and ``extra`` top-level entries
    (its stamps, as ``output/update.write_folder_stamps`` adds them to any folder's store).
    ``stamps``: the parts' row stamps by name, as the ranks sent them (not saved)."""

    folder: Path
    settings: dict[str, Any]
    parts: dict[str, dict[str, Any]]
    stamps: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        from ..output.files import MANIFEST_NAME
        from ..output.parts import manifest_document, write_json_atomic

        write_json_atomic(manifest_document(self.settings, self.parts, **self.extra),
                          self.folder / MANIFEST_NAME)
