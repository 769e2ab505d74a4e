"""Start at min on a real kube-apiserver (real Job controller and scheduler, no kubelet: phases,
IPs and readiness are written through `pods/status`): an in-place elastic Indexed Job with
`spotguard.io/start-at-min: "true"` gets no membership while fewer than min-replicas pods are
Ready, its first membership (marked `start`) lists exactly the min Ready pods once they are, and
the next pod to become Ready is admitted in place by the next generation."""
from __future__ import annotations

import asyncio
import json
import logging

from spotguard.wire import names
from tests.k8s_world import refusals, set_pod_running, wait_until
from tests.test_k8s_supervisor import World, _controller, _job

import pytest

pytestmark = pytest.mark.k8s
INDEX = "batch.kubernetes.io/job-completion-index"
PORT = "31000"


def _start_at_min_job(namespace: str) -> dict:
    job = _job("train", namespace, 3, {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2",
                                       names.ANN_IN_PLACE: "true", names.ANN_START_AT_MIN: "true"})
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": names.ENV_RDZV_PORT, "value": PORT}]
    return job


def _membership(world: World, name: str) -> dict | None:
    pod = world.core.read_namespaced_pod(name, world.ns)
    text = (pod.metadata.annotations or {}).get(names.ANN_MEMBERSHIP)
    return json.loads(text) if text else None


async def test_the_job_starts_with_min_ready_pods_and_admits_the_next_ready_one_in_place(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world = World(plane, ns)
    for _ in range(3):
        await asyncio.to_thread(world.add_node)
    await asyncio.to_thread(world.batch.create_namespaced_job, ns, _start_at_min_job(ns))
    pods = {int(p.metadata.annotations[INDEX]): p for p in await asyncio.to_thread(world.running_on, 3)}
    for i, pod in pods.items():  # every worker runs and waits; none has said it is ready yet
        await asyncio.to_thread(set_pod_running, plane, ns, pod.metadata.name, f"10.244.0.{i + 1}", i == 0)
    controller = _controller(plane, ns)
    await controller.start()
    key = ("Job", ns, "train")
    try:
        await asyncio.to_thread(wait_until, lambda: all(
            (controller.cache.pods.get((ns, p.metadata.name)) or {}).get("status", {}).get("phase") == "Running"
            for p in pods.values()), 30, "the supervisor sees the pods Running")
        await controller.reconciler.reconcile(key)  # one Ready pod, min is 2: nothing starts
        for pod in pods.values():
            assert await asyncio.to_thread(_membership, world, pod.metadata.name) is None

        await asyncio.to_thread(set_pod_running, plane, ns, pods[1].metadata.name, "10.244.0.2", True)

        def told(*indexes: int, newer: int = 0):
            values = [_membership(world, pods[i].metadata.name) for i in indexes]
            first = values[0]
            return first if first and first["generation"] > newer and all(v == first for v in values) else None
        start = await asyncio.to_thread(wait_until, lambda: told(0, 1, 2), 30, "the first membership")
        assert start["hosts"] == [pods[0].spec.node_name, pods[1].spec.node_name]
        assert start["start"] is True and start["store"] == f"10.244.0.1:{PORT}" and start["world_size"] == 2

        await asyncio.to_thread(set_pod_running, plane, ns, pods[2].metadata.name, "10.244.0.3", True)
        admitted = await asyncio.to_thread(wait_until, lambda: told(0, 1, 2, newer=start["generation"]), 30,
                                           "the Ready pod admitted")
        assert admitted["hosts"] == [*start["hosts"], pods[2].spec.node_name]
        assert "start" not in admitted and admitted["store"] == start["store"] and admitted["world_size"] == 3
        assert admitted["generation"] == start["generation"] + 1
        record = await asyncio.to_thread(world.record)
        assert record["members"] == admitted["hosts"] and len(record["member_pods"]) == 3
        job = await asyncio.to_thread(world.job)
        assert job["spec"]["parallelism"] == 3 and not job["spec"].get("suspend")
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)
