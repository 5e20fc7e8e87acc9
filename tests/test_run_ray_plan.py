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
