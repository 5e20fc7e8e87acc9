"""Which items share a batch: bins of item indices, each of a total cost (patches) at most a
capacity. Torch-free: the run's plan (``run/plan``), ``api.Encoder`` and the benchmarks pack
with it alike."""

from __future__ import annotations

from typing import Sequence


def pack_bins(costs: Sequence[int], capacity: int, max_items: int | None = None) -> list[list[int]]:
    """First-fit-decreasing bin packing: bins of item indices (ascending), each of cost at
    most ``capacity`` (a larger item alone) and at most ``max_items`` items, ordered by their
    smallest index so that work flows roughly in input order."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost = costs[i]
        for b, load in enumerate(loads):
            if load + cost <= capacity and (max_items is None or len(bins[b]) < max_items):
                bins[b].append(i)
                loads[b] += cost
                break
        else:
            bins.append([i])
            loads.append(cost)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


#: Under ``pack_in_order`` an item joins one of the last this many batches opened, so that a
#: batch's images lie close together in input order.
OPEN_BINS = 4


def pack_in_order(costs: Sequence[int], capacity: int, max_items: int | None = None,
                  open_bins: int = OPEN_BINS) -> list[list[int]]:
    """Bins like ``pack_bins``'s, filled in input order: each item goes to the first of the
    last ``open_bins`` bins it fits in, else opens one. The bins' work flows in input order
    (an item is never more than ``open_bins`` bins from its neighbours), at a little more
    padding than first-fit-decreasing."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, cost in enumerate(costs):
        for b in range(max(0, len(bins) - open_bins), len(bins)):
            if loads[b] + cost <= capacity and (max_items is None or len(bins[b]) < max_items):
                bins[b].append(i)
                loads[b] += cost
                break
        else:
            bins.append([i])
            loads.append(cost)
    return bins
