"""How long a rank's host wait on a gloo collective takes past the moment the collective
completes, for three ways of waiting: one blocking wait (which a signal cannot interrupt),
``run/dist``'s waits in slices of ``WAIT_SLICE_S``, and polling ``is_completed`` with sleeps
that double from 0.2 ms to 50 ms. Rank 1 joins each collective ``delay`` ms late; the figure
is rank 0's wait minus that delay, the median of ``ROUNDS``, interleaved by round.

    torchrun --nproc-per-node 2 benchmarks/gloo_wait.py
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist

from dsv4enc.run.dist import WAIT_SLICE_S

ROUNDS = 30
DELAYS_MS = (0, 5, 30, 120)


def blocking(work) -> None:
    work.wait(datetime.timedelta(seconds=60))


def sliced(work) -> None:
    while True:
        try:
            work.wait(datetime.timedelta(seconds=WAIT_SLICE_S))
            return
        except RuntimeError:
            pass


def polling(work) -> None:
    pause = 0.0002
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    work.wait()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = [torch.empty(4) for _ in range(2)]
    ways = {"blocking": blocking, "sliced": sliced, "polling": polling}
    for delay in DELAYS_MS:
        extra: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(ROUNDS):
            for name, wait in ways.items():
                dist.barrier()
                if rank == 1:
                    time.sleep(delay / 1000)
                start = time.perf_counter()
                wait(dist.all_gather(out, torch.zeros(4), async_op=True))
                extra[name].append((time.perf_counter() - start) * 1000 - delay)
        if rank == 0:
            print(f"delay {delay:4d} ms: " + ", ".join(
                f"{name} +{statistics.median(values):.2f} ms" for name, values in extra.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
