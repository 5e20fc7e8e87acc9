"""Which items share a batch: bins of item indices, each of a total cost (patches) at most a
capacity. Torch-free: the run's plan (``run/plan``), ``api.Encoder`` and the benchmarks pack
with it alike."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


def pack_bins(costs: Sequence[int], capacity: int, max_items: int | None = None) -> list[list[int]]:
    """First-fit-decreasing bin packing: bins of item indices (ascending), each of cost at
    most ``capacity`` (a larger item alone) and at most ``max_items`` items, ordered by their
    smallest index so that work flows roughly in input order."""
    bins = _fill(sorted(range(len(costs)), key=lambda i: (-costs[i], i)), costs, capacity,
                 max_items, range)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


#: Under ``pack_in_order`` an item joins one of the last this many batches opened, so that a
#: batch's images lie close together in input order.
OPEN_BINS = 4


def pack_in_order(costs: Sequence[int], capacity: int,
                  max_items: int | None = None) -> list[list[int]]:
    """Bins like ``pack_bins``'s, filled in input order: each item goes to the first of the
    last ``OPEN_BINS`` bins it fits in, else opens one. The bins' work flows in input order
    (an item is never more than ``OPEN_BINS`` bins from its neighbours), at a little more
    padding than first-fit-decreasing."""
    return _fill(range(len(costs)), costs, capacity, max_items,
                 lambda opened: range(max(0, opened - OPEN_BINS), opened))


def _fill(order: Iterable[int], costs: Sequence[int], capacity: int, max_items: int | None,
          candidates: Callable[[int], Iterable[int]]) -> list[list[int]]:
    """Place each item of ``order`` in the first bin of ``candidates(bins opened)`` it fits
    in (cost and item count), else in a new bin."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        cost = costs[i]
        for b in candidates(len(bins)):
            if loads[b] + cost <= capacity and (max_items is None or len(bins[b]) < max_items):
                bins[b].append(i)
                loads[b] += cost
                break
        else:
            bins.append([i])
            loads.append(cost)
    return bins
