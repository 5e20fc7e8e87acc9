"""Encoding the planned parts: decoded images -> batches on the engine -> rows, one part
after another, with progress and stops agreed between ranks (``PartEncoder``)."""

from __future__ import annotations

import time
from typing import Collection, Iterable, Iterator, Sequence

import torch

from .. import storage
from ..engine.batching import BatchLoop
from ..images.decode import Decoded, DecodeStream, describe_error, patches_tensor
from ..engine.engine import Engine
from .options import EncodeOptions
from ..engine.packing import output_grid
from .plan import Part, Planned, part_name
from .progress import RunProgress
from .stopping import StopSignals, StoppedWaiting
from .summary import RunSummary
from .ranks import Topology
from ..output.parts import Row
from ..output.update import Update


class PartEncoder:
    """Encodes the run's parts batch by batch through the batch loop, yielding finished parts
    (``_piece``'s tuples). Under torchrun every batch ends in collectives (``Topology``): stop
    agreement with the progress, and gathered data parallelism's rows."""

    def __init__(self, engine: Engine, opts: EncodeOptions, ranks: Topology,
                 progress: RunProgress, summary: RunSummary, stop: StopSignals,
                 update: Update | None = None) -> None:
        """``update``: an ``--update``'s ``output/update.Update``, whose ``carried`` inputs
        take their old rows (they are in no batch: ``plan.plan_batches``)."""
        self.engine, self.opts, self.ranks, self.update = engine, opts, ranks, update
        self.progress, self.summary, self.stop = progress, summary, stop
        self.ratio = engine.cfg.downsample_ratio
        # tags: (index, key, decoded image)
        self.loop = BatchLoop(engine, opts.pool, name_of=lambda tag: tag[1],
                              remedy="rerun with --out-dtype float32", copy=False)
        # Progress is counted where rows are made, summed over ranks at each step (under TP
        # every rank makes the same rows: rank 0 counts them; header failures: their owner).
        self._counts_encoded = ranks.is_main or ranks.splits_images
        self._counts_header_failures = ranks.is_main or ranks.sharded
        # not yet shown: images, tokens, failed, and the planned tokens of images that then
        # failed to decode (the ETA no longer waits for them)
        self._pending = [0, 0, 0, 0]

    @property
    def me(self) -> int:
        """Whose batches this process encodes (its rank when the ranks split the images)."""
        return self.ranks.rank if self.ranks.splits_images else 0

    def batch_sizes(self, planned: Sequence[Planned], batches: list[list[list[int]]]) -> list[int]:
        """This rank's batch sizes in tokens (``batches``: per part, per rank); under
        gathered data parallelism every rank's load is noted in the summary too."""
        if self.ranks.gathered:
            loads = self.summary.rank_loads
            for plan in batches:
                loads.extend([0.0] * (len(plan) - len(loads)))
                for rank, share in enumerate(plan):
                    loads[rank] += sum(planned[i].tokens for b in share for i in b)
        return [sum(planned[i].tokens for i in batch)
                for plan in batches for batch in plan[self.me]]

    def run(self, planned: Sequence[Planned], parts: Iterable[tuple[Part, list[list[list[int]]]]],
            decoded: Iterator[tuple[int, Decoded]]) -> Iterator[tuple]:
        """Encode ``parts`` (each with its batches, per rank) from ``decoded`` (this rank's
        images in the batches' order); yields each finished part. Under gathered data
        parallelism a part is one segment of every rank's share, so rank 0 yields its
        finished prefix after each step: the writer commits it by --commit-every."""
        me = self.me
        for part, plan in parts:
            # a carried error row is the old output's, even where its header fails again now
            carried = self.update.rows(part.indices, planned) if self.update is not None else {}
            rows = {i: error_row(planned[i]) for i in part.indices
                    if planned[i].error and i not in carried}
            if self._counts_header_failures:
                self._note(rows.values())
            rows.update(carried)
            self.summary.reused += len(carried)
            done = part.start  # rows before it were yielded (gathered pieces)
            for step in range(max(len(share) for share in plan)):
                batch = plan[me][step] if step < len(plan[me]) else []
                try:
                    local = self.submit_batch(planned, batch, decoded)
                except StoppedWaiting:
                    return  # the part in progress is dropped; finished ones are committed
                local.update(self._rows(self.loop.collect_ready()))
                rows.update(self._finished(local))
                if self._stop_agreed():
                    return
                if self.ranks.gathered and self.ranks.writes:
                    piece, done = self._piece(part, rows, done, carried)
                    if piece is not None:
                        yield piece
            rows.update(self._finished(self._rows(self.loop.drain())))
            self._share_progress()
            piece, done = self._piece(part, rows, done, carried, last=True)
            rows = None
            if self.ranks.writes and piece is not None:
                yield piece
            piece = None

    def _piece(self, part: Part, rows: dict[int, Row], done: int, carried: Collection[int],
               last: bool = False) -> tuple[tuple | None, int]:
        """The rows of ``part`` finished from input ``done`` on without a gap (all of them when
        ``last``), taken out of ``rows`` and counted, as ``(name, start, end, digest, closes,
        rows)`` (None when there are none; ``closes``: it ends the plan's part), and where the next
        piece starts. A whole part keeps its name and digest; a piece is named for its start."""
        if last:
            end = part.end
        else:  # a gathered part covers start..end: its indices are that range
            end = done
            while end < part.end and end in rows:
                end += 1
        if end == done:
            return None, done
        whole = (done, end) == (part.start, part.end)
        indices = part.indices if whole else range(done, end)
        ordered = [rows.pop(i) for i in indices]
        self.summary.count_rows([row for i, row in zip(indices, ordered) if i not in carried])
        name, digest = ((part.name, part.digest) if whole
                        else (part_name(done, part.part_images), ""))
        return (name, done, end, digest, end == part.part_end, ordered), end

    def _stop_agreed(self) -> bool:
        """Whether any rank was signalled; also brings every rank's progress to rank 0 (the
        same collective, so progress costs no extra round trip per batch). A store that is
        down on any rank (``storage.check_stores``) stops every rank with its error."""
        try:
            storage.check_stores()
            down = None
        except storage.StoreDown as exc:
            down = exc
        reports = self._share_progress(self.stop.signum, down)
        problem = next((exc for _, _, exc in reports if exc is not None), None)
        if problem is not None:
            raise problem
        signums = [signum for signum, _, _ in reports if signum is not None]
        if signums and self.stop.signum is None:
            self.stop.signum = signums[0]
        return bool(signums)

    def _note(self, rows) -> None:
        """Count finished rows for the progress."""
        for row in rows:
            self._pending[0] += 1
            if row.error is None:
                self._pending[1] += row.vit_h * row.vit_w
            else:
                self._pending[2] += 1

    def _share_progress(self, signum: int | None = None, problem: Exception | None = None,
                        ) -> list[tuple[int | None, list[int], Exception | None]]:
        """(signal, progress not yet shown, problem) of every rank (this rank's alone without
        torchrun), in one collective per batch; their progress shown."""
        pending, self._pending = self._pending, [0, 0, 0, 0]
        reports = self.ranks.gather((signum, pending, problem))
        images, tokens, failed, dropped = (sum(counts[k] for _, counts, _ in reports)
                                           for k in range(4))
        if images:
            self.progress.advance(images, tokens, failed, dropped)
        return reports

    # -- one batch ---------------------------------------------------------------
    def _next_decoded(self, decoded: Iterator[tuple[int, Decoded]]) -> tuple[int, Decoded]:
        """The next decoded image. One process: a signal that arrives while it waits (a slow
        or hung decode can take up to --decode-timeout) raises ``StoppedWaiting`` at once.
        Under torchrun every rank waits, and the ranks agree on stopping after the batch."""
        if self.ranks.dist is not None or not isinstance(decoded, DecodeStream):
            return next(decoded)
        while (item := decoded.next_within(STOP_POLL_S)) is None:
            if self.stop.requested():
                raise StoppedWaiting
        return item

    def submit_batch(self, planned: Sequence[Planned], batch: list[int],
                     decoded: Iterator[tuple[int, Decoded]]) -> dict[int, Row]:
        """Take a batch's decoded images and start them on the engine. Returns the rows of
        images that failed to decode; the others come from ``loop``."""
        rows: dict[int, Row] = {}
        ready: list[tuple[int, Decoded]] = []
        began = time.perf_counter()
        for expected in batch:
            index, result = self._next_decoded(decoded)
            assert index == expected, "decode stream out of step with the plan"
            path = planned[index].item.path
            # what the decoder found, for the store's health (an input in a store)
            if storage.note_row(path, result.error, result.unavailable_since) \
                    and self.ranks.dist is None:  # one process stops at once; ranks agree later
                storage.check_stores()
            if result.error is not None:
                self._failed(rows, index, planned[index], result.error)
            else:
                ready.append((index, result))
        self.summary.decode_wait_s += time.perf_counter() - began
        images = self._patches(planned, ready, rows)
        if not images:
            return rows
        packed = self.loop.submit([(index, planned[index].item.key, d) for index, d, _ in images],
                                  [(patches, d.n_h, d.n_w) for _, d, patches in images])
        for _, d in ready:  # packed: the decode pool's shared slots are free again
            d.patches = None
        if self.opts.engine.features == "aligner":
            self.summary.merge_pad_tokens += packed.n_rows * self.ratio ** 2 - packed.n_tokens
        return rows

    def _failed(self, rows: dict[int, Row], index: int, entry: Planned, error: str) -> None:
        """Input ``index``'s error row (``entry``: its plan), its tokens no longer awaited."""
        rows[index] = error_row(entry, error)
        if self._counts_encoded:
            self._pending[3] += entry.tokens

    def _patches(self, planned: Sequence[Planned], ready: list[tuple[int, Decoded]],
                 rows: dict[int, Row]) -> list[tuple[int, Decoded, torch.Tensor]]:
        """``(index, decoded, patches)`` of the decoded images: their patches as decoded, or
        made from their pixels on the engine's device (``Engine.transform``). An image whose
        transform fails (the device's memory) is an error row, as a failed decode is."""
        images = []
        for index, d in ready:
            try:
                patches = (self.engine.transform(d.pixels) if d.pixels is not None
                           else patches_tensor(d))
            except (RuntimeError, MemoryError, ValueError) as exc:
                self._failed(rows, index, planned[index],
                             f"transform failed: {describe_error(exc)}")
                continue
            finally:
                d.pixels = None  # copied: the decode pool's shared slot is free again
            images.append((index, d, patches))
        return images

    def _rows(self, done: list[tuple[tuple[int, str, Decoded], torch.Tensor]]) -> dict[int, Row]:
        """Rows of collected images (``BatchLoop`` tags and outputs), by input index."""
        rows = {}
        for (index, key, d), out in done:
            grid_h, grid_w = output_grid(d.n_h, d.n_w, self.ratio, self.opts.engine.features)
            rows[index] = Row(path=key, width=d.width, height=d.height, vit_h=d.n_h,
                              vit_w=d.n_w, grid_h=grid_h, grid_w=grid_w, embedding=out.numpy())
        return rows

    def _finished(self, local: dict[int, Row]) -> dict[int, Row]:
        """This rank's finished rows counted; under gathered data parallelism rank 0 gets
        every rank's."""
        if self._counts_encoded:
            self._note(local.values())
        if not self.ranks.gathered:
            return local
        width = self.engine.cfg.output_width(self.opts.engine.features)
        return self.ranks.exchange_rows(local, width, self.opts.pool == "mean",
                                        self.engine.out_dtype)


STOP_POLL_S = 0.1  # how often a wait for a decoded image checks for a signal


def error_row(entry: Planned, error: str | None = None) -> Row:
    """The row of an image that failed (its header's error, or ``error``)."""
    return Row(path=entry.item.key, width=entry.width, height=entry.height,
               error=error or entry.error)
