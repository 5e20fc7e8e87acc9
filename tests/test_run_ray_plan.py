"""``--engine ray``'s actor pool, decided from the cluster's resources (no Ray needed)."""

from __future__ import annotations

import pytest

from dsv4enc.errors import UsageError
from dsv4enc.run.options import EncodeOptions
from dsv4enc.run.ray_engine import ActorPlan, RayEngineOptions, actor_workers, plan_actors


class Cluster:
    def __init__(self, cpus, gpus, nodes, node_cpus):
        self.figures = (cpus, gpus, nodes, node_cpus)

    def resources(self):
        return self.figures


def started(cluster: Cluster) -> Cluster:
    """``cluster`` as a local Ray the run started (which never grows)."""
    cluster.started = True
    return cluster


def opts(**kw) -> EncodeOptions:
    return EncodeOptions(inputs=["x"], out="o.parquet", random_init=True, config="c", **kw)


def test_one_actor_per_gpu_and_their_cpus_shared():
    plan = plan_actors(opts(), RayEngineOptions(), Cluster(96, 8, 1, 96))
    assert plan == ActorPlan(actors=8, cpus=12, gpus=1, device_type="cuda")
    assert actor_workers(opts(), plan) == 11  # beside a GPU: one decoder per CPU but one


def test_without_gpus_one_actor_per_node_on_its_cpus():
    plan = plan_actors(opts(), RayEngineOptions(), Cluster(64, 0, 2, 32))
    assert plan == ActorPlan(actors=2, cpus=32, gpus=0, device_type="cpu")
    assert actor_workers(opts(), plan) == 8
    assert actor_workers(opts(workers=0), plan) == 0  # --workers wins


def test_device_cpu_and_explicit_sizes():
    plan = plan_actors(opts(device="cpu"), RayEngineOptions(actors=3), Cluster(12, 4, 1, 12))
    assert plan == ActorPlan(actors=3, cpus=4, gpus=0, device_type="cpu")
    plan = plan_actors(opts(), RayEngineOptions(actors=8, gpus_per_actor=0.5),
                       Cluster(16, 4, 1, 16))
    assert (plan.actors, plan.gpus, plan.device_type) == (8, 0.5, "cuda")


def test_impossible_requests_are_usage_errors():
    with pytest.raises(UsageError, match="no GPUs"):
        plan_actors(opts(device="cuda"), RayEngineOptions(), Cluster(8, 0, 1, 8))
    with pytest.raises(UsageError, match="at least 1"):
        plan_actors(opts(), RayEngineOptions(actors=0), Cluster(8, 0, 1, 8))
    with pytest.raises(UsageError, match="choose one"):
        plan_actors(opts(device="cpu"), RayEngineOptions(gpus_per_actor=1), Cluster(8, 1, 1, 8))


def test_a_call_is_a_parts_segments_cut_only_to_keep_every_actor_busy(tmp_path):
    """``part_calls``: the consecutive segments of one part are one call (one part file,
    named after its first segment, with the part's digest, as the local run's writer joins
    them); fewer parts than the calls wanted are cut at segment bounds; a segment already
    committed (--resume) splits its part."""
    from dsv4enc.images.headers import Planned, inputs_digest
    from dsv4enc.images.items import InputItem
    from dsv4enc.run.plan import cut_parts, plan_segments
    from dsv4enc.run.ray_engine import part_calls

    planned = []
    for i in range(10):
        (tmp_path / f"{i}.png").write_bytes(b"x")
        bad = i == 5  # its header could not be read: no patches
        planned.append(Planned(InputItem(f"{i}.png", str(tmp_path / f"{i}.png")), 8, 8,
                               0 if bad else 2, 0 if bad else 2, error="broken" if bad else None))
    parts = list(cut_parts(planned, 4))
    assert [(p.start, p.end) for p in parts] == [(0, 1), (1, 4), (4, 8), (8, 10)]  # by keys
    segments = [segment for part in parts  # about two images a segment
                for segment in plan_segments(planned, part, segment_tokens=8)]
    assert [(s.start, s.end) for s in segments][1:3] == [(1, 3), (3, 4)]

    calls = part_calls(planned, segments, 8, None, wanted=1)
    assert [(c.name, c.start, c.end) for c in calls] == [
        ("part-000000", 0, 1), ("part-000000_000001", 1, 4), ("part-000001", 4, 8),
        ("part-000002", 8, 10)]
    assert calls[2].digest == inputs_digest(planned[4:8])
    assert list(calls[2].planned) == [4, 5, 6, 7]  # every input, in input order
    assert calls[2].planned[5].error == "broken"  # a header's error travels with its entry
    assert sorted(i for b in calls[2].batches for i in b) == [4, 6, 7]  # readable ones only

    cut = part_calls(planned, segments, 8, None, wanted=len(segments))
    assert [(c.start, c.end) for c in cut] == [(s.start, s.end) for s in segments]
    assert [c.digest for c in cut] == [s.digest for s in segments]

    resumed = part_calls(planned, segments[2:], 8, None, wanted=1)
    assert [(c.name, c.start, c.end) for c in resumed][:2] == [
        ("part-000000_000003", 3, 4), ("part-000001", 4, 8)]


@pytest.mark.parametrize("per_gpu", [float("nan"), float("inf")])
def test_gpus_per_actor_that_is_no_finite_number_is_a_usage_error(per_gpu):
    """--ray-gpus-per-actor nan was a traceback (int(nan)), inf a wait for inf GPUs."""
    with pytest.raises(UsageError, match="--ray-gpus-per-actor must be"):
        plan_actors(opts(), RayEngineOptions(gpus_per_actor=per_gpu), Cluster(8, 1, 1, 8))


def test_device_cuda_with_no_gpu_per_actor_is_refused():
    """--device cuda with --ray-gpus-per-actor 0 on a cluster with GPUs ran the actors on the
    CPU (Ray hides every GPU from an actor given none), against the --device asked for."""
    with pytest.raises(UsageError, match="choose one"):
        plan_actors(opts(device="cuda"), RayEngineOptions(gpus_per_actor=0), Cluster(8, 2, 1, 8))


def test_gpus_a_started_ray_lacks_are_told_the_option_that_asks_for_them():
    """One actor with a GPU on a local Ray without: the line said "1 encoder actor need ...:
    ask for fewer with --ray-actors", which one actor cannot; it names the GPUs' option."""
    with pytest.raises(UsageError) as refused:
        plan_actors(opts(), RayEngineOptions(gpus_per_actor=1), started(Cluster(8, 0, 1, 8)))
    assert str(refused.value).startswith("1 encoder actor needs 1 GPUs (1 each), and the "
                                         "cluster has 0")
    assert str(refused.value).endswith("ask for fewer with --ray-gpus-per-actor")
    with pytest.raises(UsageError, match="3 encoder actors need 3 CPUs .* with --ray-actors$"):
        plan_actors(opts(), RayEngineOptions(actors=3), started(Cluster(2, 0, 1, 2)))


@pytest.mark.parametrize("gpus", [0, 2])
def test_a_device_that_is_no_device_is_refused_as_the_local_run_does(gpus):
    """--device gpu (or mps, or a typo) ran the actors on the CPU, or on a GPU, without a
    word, where the local run refuses it."""
    with pytest.raises(UsageError, match="unknown device 'gpu'"):
        plan_actors(opts(device="gpu"), RayEngineOptions(), Cluster(8, gpus, 1, 8))
