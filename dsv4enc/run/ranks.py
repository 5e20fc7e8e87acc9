"""How a run is spread over processes, and the one place that talks to the other ranks.

A ``Topology`` is built once per run from the torchrun context (``dist.DistContext``, or
None for a plain launch). Its kind: ``single`` (no collectives); ``gathered`` (data parallel:
each rank encodes its share of every part, rank 0 gathers the rows and writes them);
``sharded`` (``--shard-output``: each rank writes its own share); ``tensor-parallel`` (the
tower split over the ranks, rank 0 writes). Every collective of the run goes through it.
This module imports no torch: a plain launch never pays for it.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable

from ..errors import DsvError

if TYPE_CHECKING:
    from .summary import RunSummary
    from ..output.parts import PartStore


def launched_ranks() -> int:
    """How many ranks torchrun started (1 for a plain launch), from the environment alone:
    for what runs before the process group exists (the listing, signal handling)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class Topology:
    """The run's ranks (see the module's doc). ``dist``: the torchrun context or None."""

    def __init__(self, dist=None, shard_output: bool = False) -> None:
        self.dist = dist
        self.shard_output = shard_output and dist is not None
        self.tensor_parallel = False  # set by ``split_tower``

    # -- who does what ---------------------------------------------------------------
    @property
    def kind(self) -> str:
        if self.dist is None:
            return "single"
        if self.tensor_parallel:
            return "tensor-parallel"
        return "sharded" if self.shard_output else "gathered"

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
        return self.kind in ("gathered", "sharded")

    @property
    def gathered(self) -> bool:
        return self.kind == "gathered"

    @property
    def sharded(self) -> bool:
        return self.kind == "sharded"

    # -- set-up ----------------------------------------------------------------------
    def split_tower(self, model, tp_mode: str) -> None:
        """Tensor parallelism (``--tp-mode weights``): slice ``model`` into this rank's
        shard; when the world size does not divide the tower it stays whole (data
        parallel)."""
        if self.dist is not None and tp_mode == "weights":
            from ..tower.tensor_parallel import apply_tensor_parallel

            self.tensor_parallel = apply_tensor_parallel(model, self.dist.rank,
                                                         self.dist.world_size,
                                                         self.dist.all_reduce_sum)

    # -- collectives -----------------------------------------------------------------
    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (this rank's alone for a single process)."""
        return [value] if self.dist is None else self.dist.all_gather_object(value)

    def main_then_all(self, action: Callable[[], None]) -> None:
        """Run ``action`` (an output check) on rank 0 only, then let every rank raise the
        DsvError it raised, so that no rank is left waiting in a collective for a rank 0 that
        gave up (and reports a dead peer instead of the real reason). Also the ranks'
        barrier."""
        if self.dist is None:
            action()
            return
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

        One manifest (rank 0's): rank 0 tells the others. One per rank (--shard-output):
        a range is redone by all when any rank lacks its part (every batch ends in
        collectives, so all ranks walk the same parts)."""
        if self.dist is None:
            return todo, problem
        if not self.shard_output:
            return self.gather((todo, problem))[0]
        everyone = self.gather((todo, problem))
        problem = next((exc for _, exc in everyone if exc is not None), None)
        return sorted({tuple(r) for ranges, _ in everyone for r in ranges or ()}), problem

    def agree_on_stop(self, signum: int | None, progress: list[int],
                      problem: Exception | None = None,
                      ) -> list[tuple[int | None, list[int], Exception | None]]:
        """(signal, progress not yet shown, problem) of every rank: one collective per batch
        agrees on stopping (a signal, or a problem such as a store that is down: every rank
        raises it) and brings every rank's progress to rank 0."""
        return self.gather((signum, progress, problem))

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
            block = block.cpu()
            offset = 0
            for index, fields, n in rank_meta:
                row = Row(**fields)
                if n:
                    emb = block[offset:offset + n]
                    row.embedding = (emb.reshape(width) if pooled else emb).numpy()
                    offset += n
                rows[index] = row
        return rows

    def merge_manifests(self, store: PartStore) -> None:
        """--shard-output: rank 0 lists every rank's parts in one manifest."""
        from ..output.parts import MANIFEST_NAME, manifest_document, write_json_atomic

        everything = self.gather(store.parts)
        if self.is_main:
            merged = {name: part for parts in everything for name, part in parts.items()}
            write_json_atomic(manifest_document(store.settings, merged),
                              store.folder / MANIFEST_NAME)

    def sum_rank_counts(self, summary: RunSummary) -> None:
        """--shard-output: each rank counted only its own rows; the summary shows them all."""
        counts = self.gather((summary.encoded, summary.failed, summary.tokens,
                              summary.errors, summary.error_examples))
        summary.encoded = sum(c[0] for c in counts)
        summary.failed = sum(c[1] for c in counts)
        summary.rank_loads = [float(c[2]) for c in counts]
        summary.tokens = sum(c[2] for c in counts)
        summary.errors, summary.error_examples = {}, {}
        for _, _, _, errors, examples in counts:
            for message, n in errors.items():
                summary.add_error(message, examples[message], n)

    def sum_rank_tokens(self, summary: RunSummary, padded_tokens: int) -> None:
        """Gathered data parallel: every rank encoded its own share of the tokens; count
        them all."""
        counts = self.gather((summary.tokens, padded_tokens, summary.merge_pad_tokens))
        summary.tokens = sum(c[0] for c in counts)
        summary.padded_tokens = sum(c[1] for c in counts)
        summary.merge_pad_tokens = sum(c[2] for c in counts)

