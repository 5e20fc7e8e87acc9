"""One rank of a multi-process sharding test; launched by tests/test_run_sharding.py with
``python -m torch.distributed.run --standalone --nproc-per-node N dist_worker.py SCENARIO OUT``.

Each rank writes OUT/rank{R}.json: {check name: "ok" or what went wrong}, so that the test
reports every check, not only the first failure.

Scenarios:
  checks     gather_rows, object gather, barrier, tensor-parallel forward.
  hang       rank 1 stays alive but never joins the collective; rank 0 must time out.
  exit       rank 1 exits right after a first collective; rank 0 must fail fast.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from dsv4enc.tower.attention import VarlenSpans
from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.errors import DistributedError
from dsv4enc.tower.model import rope_tables
from dsv4enc.engine.packing import pack
from dsv4enc.run.plan import assign_greedy
from dsv4enc.run.dist import gather_rows, init_distributed, shutdown
from dsv4enc.tower.tensor_parallel import apply_tensor_parallel

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TIMEOUT_S = 2.0


def image_rows(i: int, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows every rank can recompute for image i: (n, width), distinct per image and row."""
    base = torch.arange(n * width, dtype=torch.float32).view(n, width) / 64
    return (base + i).to(dtype)


def check_gather_zero_rows(ctx) -> None:
    # rank 0 holds 3 rows, rank 1 none; the counts come from the "plan"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        counts = [3, 0]
        local = image_rows(ctx.rank, counts[ctx.rank], 5, dtype)
        parts = gather_rows(ctx, local, counts)
        assert [tuple(p.shape) for p in parts] == [(3, 5), (0, 5)], [p.shape for p in parts]
        assert all(p.dtype == dtype for p in parts)
        assert torch.equal(parts[0], image_rows(0, 3, 5, dtype))


def check_gather_exchanged_counts(ctx) -> None:
    counts = [2, 7]
    local = image_rows(ctx.rank, counts[ctx.rank], 4, torch.float16)
    parts = gather_rows(ctx, local, None)
    for r, part in enumerate(parts):
        assert torch.equal(part, image_rows(r, counts[r], 4, torch.float16)), r


def check_gather_all_empty(ctx) -> None:
    parts = gather_rows(ctx, torch.zeros(0, 6), [0, 0])
    assert [tuple(p.shape) for p in parts] == [(0, 6), (0, 6)]


def run_plan(ctx, grids: list[tuple[int, int]]) -> None:
    """The data-parallel flow for one round: plan, local rows, gather, cut into images."""
    rows_per_image = [-(-h // 3) * -(-w // 3) for h, w in grids]
    assignment = assign_greedy([h * w for h, w in grids], ctx.world_size)
    mine = assignment[ctx.rank]
    local = torch.cat([image_rows(i, rows_per_image[i], 8, torch.float16) for i in mine]
                      or [torch.zeros(0, 8, dtype=torch.float16)])
    parts = gather_rows(ctx, local, [sum(rows_per_image[i] for i in a) for a in assignment])
    images = {}
    for part, indices in zip(parts, assignment, strict=True):
        sizes = [rows_per_image[i] for i in indices]
        images.update(zip(indices, torch.split(part, sizes)))
    assert sorted(images) == list(range(len(grids)))
    for i, rows in images.items():
        assert torch.equal(rows, image_rows(i, rows_per_image[i], 8, torch.float16)), i


def check_fewer_images_than_ranks(ctx) -> None:
    run_plan(ctx, [(10, 14)])
    run_plan(ctx, [])


def check_plan_round(ctx) -> None:
    run_plan(ctx, [(10, 14), (27, 27), (4, 50), (12, 12), (3, 3), (20, 30), (16, 16)])


def check_object_gather_and_barrier(ctx) -> None:
    got = ctx.all_gather_object({"rank": ctx.rank, "errors": {ctx.rank * 10: "bad"}})
    assert got == [{"rank": r, "errors": {r * 10: "bad"}} for r in range(ctx.world_size)], got
    ctx.barrier()
    total = ctx.all_reduce_sum(torch.ones(3) * (ctx.rank + 1))
    assert total.tolist() == [3.0, 3.0, 3.0], total


def packed_inputs(cfg: VisionConfig, features: str):
    gen = torch.Generator().manual_seed(7)
    grids = [(4, 5), (3, 3), (7, 2), (6, 6)]
    items = [(torch.randn(h * w, cfg.patch_dim, generator=gen).to(torch.bfloat16), h, w)
             for h, w in grids]
    batch = pack(items, cfg.downsample_ratio, features)
    cos, sin = rope_tables(batch.positions, cfg)
    return dict(patches=batch.patches, cos=cos, sin=sin,
                spans=VarlenSpans.from_lengths(batch.lengths, "cpu"),
                merge_index=batch.merge_index, merge_mask=batch.merge_mask, features=features)


def check_tensor_parallel(ctx) -> None:
    cfg = VisionConfig.from_file(CONFIGS / "tiny.json")
    ckpt = random_checkpoint(cfg, seed=3)
    whole = build_tower(ckpt)
    shard = build_tower(ckpt)
    assert apply_tensor_parallel(shard, ctx.rank, ctx.world_size, ctx.all_reduce_sum) is True
    assert shard.vision.blocks[0].attn.wqkv.weight.shape == (3 * cfg.dim // 2, cfg.dim)
    for features in ("aligner", "vit"):
        inputs = packed_inputs(cfg, features)
        with torch.inference_mode():
            want = whole.forward_packed(**inputs)
            got = shard.forward_packed(**inputs)
        assert got.shape == want.shape, (got.shape, want.shape)
        rel = ((got - want).norm() / want.norm()).item()
        worst = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-5 and worst < 1e-5, (features, rel, worst)


CHECKS = [check_gather_zero_rows, check_gather_exchanged_counts, check_gather_all_empty,
          check_fewer_images_than_ranks, check_plan_round, check_object_gather_and_barrier,
          check_tensor_parallel]


def run_checks(ctx) -> dict:
    results = {}
    for check in CHECKS:
        try:
            check(ctx)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc(limit=3)
    return results


def run_dead_peer(ctx, mode: str, out: Path) -> dict:
    ctx.barrier()  # the group works
    if ctx.rank == 1:
        if mode == "exit":
            os._exit(0)  # no goodbye: the socket just closes
        deadline = time.monotonic() + 30  # stay alive, outside any collective
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"peer": "ok"}
    start = time.monotonic()
    try:
        gather_rows(ctx, torch.ones(4, 3), [4, 4])
        return {"error": None}
    except DistributedError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", TIMEOUT_S)
    assert ctx is not None and ctx.backend == "gloo"
    results = run_checks(ctx) if scenario == "checks" else run_dead_peer(ctx, scenario, out)
    tmp = out / f"rank{ctx.rank}.json.tmp"
    tmp.write_text(json.dumps(results))
    tmp.rename(out / f"rank{ctx.rank}.json")
    if scenario == "checks":
        shutdown(ctx)
    # After a failed collective the group is broken: skip its teardown and leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
