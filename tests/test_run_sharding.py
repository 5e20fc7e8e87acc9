"""Sharding (SPEC §7-8): assignment, gathering, tensor parallel, failure of a peer.

Multi-process tests start 2 gloo ranks on the CPU through torchrun (tests/dist_worker.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4enc.tower.checkpoint import build_tower, random_checkpoint
from dsv4enc.tower.config import VisionConfig
from dsv4enc.errors import UsageError
from dsv4enc.images.decode import Probe
from dsv4enc.images.items import InputItem
from dsv4enc.run.plan import assign_greedy, cost_function, flops_cost, patch_cost, with_grids
from dsv4enc.run.ranks import Topology
from dsv4enc.run.dist import DistContext, init_distributed
from dsv4enc.tower.tensor_parallel import apply_tensor_parallel
from dsv4enc.tower.transform import plan_canvas

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
WORKER_TIMEOUT_S = 2.0  # the collective timeout dist_worker.py uses


def imbalance(loads) -> float:
    """max / mean of the per-rank loads (1.0 is perfect; 1.0 when there is no work)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def rank_loads(costs, assignment) -> list[float]:
    """Total cost per rank."""
    return [float(sum(costs[i] for i in indices)) for indices in assignment]


def fake_ctx(rank: int, world_size: int) -> DistContext:
    """A context without a process group: enough for code that decides before any collective."""
    return DistContext(rank, world_size, rank, world_size, torch.device("cpu"), "gloo", 5.0)


# ------------------------------------------------------------------------------- assignment

@pytest.mark.parametrize("costs, world, expected", [
    ([5, 3, 3, 2, 2, 1], 2, [[0, 3, 5], [1, 2, 4]]),
    ([1, 1, 1, 1], 3, [[0, 3], [1], [2]]),  # equal loads: lowest rank first
    ([2, 4, 2, 4], 2, [[0, 1], [2, 3]]),  # equal costs: lower index first
    ([7], 3, [[0], [], []]),  # fewer images than ranks
    ([], 2, [[], []]),
    ([3, 1, 2], 1, [[0, 1, 2]]),
    ([0.5, 2.5, 1.0, 1.0], 2, [[1], [0, 2, 3]]),
])
def test_assign_greedy_known(costs, world, expected):
    assert assign_greedy(costs, world) == expected


def test_assign_greedy_rejects_no_ranks():
    with pytest.raises(ValueError):
        assign_greedy([1.0], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=60), st.integers(1, 9))
def test_assign_greedy_partition_and_bound(costs, world):
    assignment = assign_greedy(costs, world)
    assert len(assignment) == world
    assert sorted(i for a in assignment for i in a) == list(range(len(costs)))
    assert all(a == sorted(a) for a in assignment)
    loads = rank_loads(costs, assignment)
    # list scheduling: no rank exceeds the mean by more than one image
    assert max(loads) <= sum(costs) / world + max(costs, default=0)


def test_imbalance():
    assert imbalance([4.0, 4.0]) == 1.0
    assert imbalance([3.0, 1.0]) == 1.5
    assert imbalance([0.0, 0.0]) == 1.0


PHOTO_SIZES = [(4032, 3024), (3024, 4032), (1920, 1080), (1080, 1920), (1280, 720),
               (800, 600), (640, 480), (6000, 4000), (4000, 6000), (512, 512), (1024, 768),
               (2048, 1536), (8000, 2000), (300, 200), (2560, 1440), (1170, 2532),
               (3000, 3000), (1600, 900), (250, 1000), (5184, 3456)]


@pytest.mark.parametrize("balance", ["patches", "flops"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_realistic_mix_is_balanced(balance, world):
    cfg = VisionConfig.from_file(ROOT / "configs" / "deepseek-v4-flash.json")
    rng = random.Random(0)
    sizes = [rng.choice(PHOTO_SIZES) for _ in range(160)]
    canvases = [plan_canvas(w, h, cfg) for w, h in sizes]
    cost = cost_function(balance, cfg)
    costs = [cost(c.n_h, c.n_w) for c in canvases]
    assert len({c.n_patches for c in canvases}) > 10  # a real mix of grids
    assert imbalance(rank_loads(costs, assign_greedy(costs, world))) <= 1.05


def test_costs():
    cfg = VisionConfig.from_file(ROOT / "configs" / "deepseek-v4-flash.json")
    assert patch_cost(27, 36) == 27 * 36
    assert cost_function("patches", cfg) is patch_cost
    # Patch equivalents: near the patch count for a tiny image, and the attention term
    # makes the cost per patch grow with the image.
    assert 1.0 <= flops_cost(3, 3, cfg) / 9 < 1.05
    per_patch = [flops_cost(n, n, cfg) / (n * n) for n in (6, 12, 24, 48)]
    assert per_patch == sorted(per_patch) and per_patch[-1] > 1.3
    assert cost_function("flops", cfg)(12, 20) == flops_cost(12, 20, cfg)
    with pytest.raises(UsageError):
        cost_function("tokens", cfg)


class _PairedRank1:
    """Rank 1 of two, its object gather answered with ``rank0``'s value (what rank 0 sent)."""

    rank, world_size, is_main = 1, 2, False

    def __init__(self, rank0) -> None:
        self.rank0 = rank0

    def all_gather_object(self, value):
        return [self.rank0, value]


def test_ranks_planning_different_inputs_stop_in_one_line():
    """A rank given one input more plans a part of other inputs than rank 0's while the
    listings are not compared yet: its header exchange refuses them, naming the cause
    (not a KeyError on a probe rank 0 never sent)."""
    cfg = VisionConfig.from_file(ROOT / "configs" / "tiny.json")
    items = [InputItem(f"{i}.png", f"/in/{i}.png") for i in range(4)]
    sent = []

    class Rank0(_PairedRank1):
        rank, is_main = 0, True

        def all_gather_object(self, value):
            sent.append(value)
            return [value, (value[0], (value[1][0], []))]  # rank 1 probed none of one image

    one = with_grids(items[3:], [(0, Probe(64, 48))], cfg, Topology(Rank0(None)), start=3)
    assert one[0].error is None and sent
    with pytest.raises(UsageError, match="the ranks listed different inputs .* from input 3 on"):
        with_grids(items[1:], [(1, Probe(64, 48))], cfg, Topology(_PairedRank1(sent[0])), start=3)
    same = with_grids(items[3:], [], cfg, Topology(_PairedRank1(sent[0])), start=3)
    assert [(p.width, p.height) for p in same] == [(64, 48)]


def test_ranks_out_of_step_are_told_without_internal_names():
    """Ranks that gather at different points of the run stop in one line that says so; it
    named the two points by their functions' names (``main_then_all``), which no user gave."""
    with pytest.raises(UsageError) as info:
        Topology(_PairedRank1(("main_then_all", None))).gather(None)
    line = str(info.value)
    assert line.startswith("the ranks fell out of step (rank 1 is at another point of the run "
                           "than rank 0)"), line
    assert "main_then_all" not in line and "test_ranks" not in line


# ---------------------------------------------------------------------- process group setup

def test_init_distributed_without_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed("auto", 10) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert init_distributed("cpu", 10) is None


def test_init_distributed_rejects_device_index(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="LOCAL_RANK"):
        init_distributed("cuda:1", 10)


# ------------------------------------------------------------------ tensor-parallel fallback

def _snapshot(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("heads, world", [(3, 2), (2, 3)])
def test_tensor_parallel_falls_back_when_not_divisible(heads, world, caplog):
    raw = json.loads((ROOT / "configs" / "tiny.json").read_text())
    raw.update(vision_n_heads=heads, vision_dim=12 * heads, vision_inter_dim=48,
               hidden_size=24)
    cfg = VisionConfig.from_dict(raw)
    model = build_tower(random_checkpoint(cfg))
    before = _snapshot(model)
    with caplog.at_level(logging.WARNING, logger="dsv4enc.run.dist"):
        assert apply_tensor_parallel(model, 0, world, lambda t: t) is False
    assert "heads" in caplog.text and "data parallel" in caplog.text
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    block = model.vision.blocks[0]
    x = torch.randn(2, cfg.dim)
    assert block.attn.combine(x) is x and model.aligner.combine(x) is x


def test_tensor_parallel_single_rank_is_a_no_op():
    model = build_tower(random_checkpoint(VisionConfig.from_file(ROOT / "configs" / "tiny.json")))
    before = _snapshot(model)
    assert apply_tensor_parallel(model, 0, 1, lambda t: t) is False
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())


# ----------------------------------------------------------------------- 2 ranks, for real

def launch(scenario: str, out: Path, nproc: int = 2, report: int | None = None,
           ) -> dict[int, dict]:
    """Run tests/dist_worker.py on ``nproc`` gloo ranks; return the results of the first
    ``report`` ranks (all by default)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # --standalone: torchrun hosts the rendezvous on a free port of its own choosing.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), scenario, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    results = {}
    for rank in range(nproc if report is None else report):
        path = out / f"rank{rank}.json"
        assert path.exists(), (f"rank {rank} wrote no results (exit {proc.returncode})\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[rank] = json.loads(path.read_text())
    return results


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory):
    return launch("checks", tmp_path_factory.mktemp("dist_checks"))


def assert_ok(results: dict[int, dict], *checks: str) -> None:
    for rank, checks_done in results.items():
        for name in checks:
            assert checks_done.get(name) == "ok", f"rank {rank}, {name}: {checks_done.get(name)}"


@pytest.mark.slow
def test_gather_rows_with_a_rank_holding_no_rows(two_rank_checks):
    assert_ok(two_rank_checks, "check_gather_zero_rows", "check_gather_all_empty",
              "check_gather_exchanged_counts")


@pytest.mark.slow
def test_gather_with_fewer_images_than_ranks(two_rank_checks):
    assert_ok(two_rank_checks, "check_fewer_images_than_ranks", "check_plan_round")


@pytest.mark.slow
def test_object_gather_barrier_and_all_reduce(two_rank_checks):
    assert_ok(two_rank_checks, "check_object_gather_and_barrier")


@pytest.mark.slow
def test_tensor_parallel_matches_single_process(two_rank_checks):
    assert_ok(two_rank_checks, "check_tensor_parallel")


@pytest.mark.slow
def test_hung_peer_times_out(tmp_path):
    result = launch("hang", tmp_path)[0]
    assert result["error"] is not None, "the collective succeeded without its peer"
    assert result["error"].startswith("rank 0: ") and "timed out after 2s" in result["error"]
    # the line says which rank stopped answering and where to look, in plain words
    assert result["error"].startswith("rank 0: rank 1 stopped answering"), result["error"]
    assert "its own lines" in result["error"] and "all_gather" not in result["error"]
    assert WORKER_TIMEOUT_S * 0.9 <= result["elapsed"] <= WORKER_TIMEOUT_S + 3


@pytest.mark.slow
def test_dead_peer_fails_fast(tmp_path):
    result = launch("exit", tmp_path, report=1)[0]
    assert result["error"] is not None and result["error"].startswith("rank 0: ")
    assert "peer rank may have died" in result["error"]
    # not "all_gather failed", an internal name: which rank stopped answering, where to look
    assert result["error"].startswith("rank 0: rank 1 stopped answering"), result["error"]
    assert "its own lines" in result["error"] and "all_gather" not in result["error"]
    assert result["elapsed"] <= WORKER_TIMEOUT_S + 3
