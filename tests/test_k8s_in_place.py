"""In-place membership changes on a real kube-apiserver (real Job controller and scheduler, no
kubelet: pod phases, IPs, readiness and exit codes are written through `pods/status`): an elastic
Indexed Job with `spotguard.io/in-place: "true"` keeps running through a reclaim notice (no
suspend, no scale), the pod on the noticed node exits 83 and the Job controller replaces it
(podFailurePolicy Ignore), the membership drops the noticed host keeping the survivors' order,
and the replacement joins only once Ready, appended after the survivors, with the store still on
the first survivor's pod. The fixed and plain elastic paths are tests/test_k8s_supervisor.py."""
from __future__ import annotations

import asyncio
import json
import logging

from spotguard.wire import names
from tests.k8s_world import refusals, set_container_exit, set_pod_running, wait_until
from tests.test_k8s_supervisor import World, _controller, _job, _mark

import pytest

pytestmark = pytest.mark.k8s
INDEX = "batch.kubernetes.io/job-completion-index"
PORT = "31000"


def _in_place_job(namespace: str) -> dict:
    job = _job("train", namespace, 4, {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2",
                                       names.ANN_IN_PLACE: "true"})
    job["spec"]["podFailurePolicy"] = {"rules": [{"action": "Ignore", "onExitCodes": {
        "containerName": "train", "operator": "In", "values": [names.EXIT_PREEMPTED]}}]}
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": names.ENV_RDZV_PORT, "value": PORT}]
    return job


def _index(pod) -> int:
    return int(pod.metadata.annotations[INDEX])


def _membership(world: World, name: str) -> dict | None:
    pod = world.core.read_namespaced_pod(name, world.ns)
    text = (pod.metadata.annotations or {}).get(names.ANN_MEMBERSHIP)
    return json.loads(text) if text else None


async def test_in_place_job_survives_a_notice_without_suspend_and_a_ready_replacement_joins(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world = World(plane, ns)
    for _ in range(4):
        await asyncio.to_thread(world.add_node)
    await asyncio.to_thread(world.batch.create_namespaced_job, ns, _in_place_job(ns))
    by_index = {_index(p): p for p in await asyncio.to_thread(world.running_on, 4)}
    for i, pod in by_index.items():  # the launcher's group: Running, never asked to be Ready
        await asyncio.to_thread(set_pod_running, plane, ns, pod.metadata.name, f"10.244.0.{i + 1}")
    controller = _controller(plane, ns)
    await controller.start()
    try:
        leaving = by_index[0]  # the lowest index leaves: its replacement must still come last
        noticed = leaving.spec.node_name
        survivors = [by_index[i].spec.node_name for i in (1, 2, 3)]
        await _mark(plane, noticed)

        def survivors_told():
            values = [_membership(world, by_index[i].metadata.name) for i in (1, 2, 3)]
            return values[0] if all(v == values[0] and v is not None for v in values) else None
        first = await asyncio.to_thread(wait_until, survivors_told, 30, "the membership on the survivors")
        assert first["hosts"] == survivors and first["store"] == f"10.244.0.2:{PORT}"
        assert first["world_size"] == 3
        record = await asyncio.to_thread(world.record)
        assert record["phase"] == "Running" and record["members"] == survivors and record["reclaims_survived"] == 1
        await asyncio.to_thread(wait_until, lambda: world.events(names.EVENT_LEAVING_IN_PLACE), 30, "the Event")

        # The ranks on the noticed node hand over and exit 83; the Job controller replaces the
        # pod (podFailurePolicy Ignore), off the tainted node, once there is room.
        await asyncio.to_thread(set_container_exit, plane, ns, leaving.metadata.name, names.EXIT_PREEMPTED)
        await asyncio.to_thread(world.add_node)

        def replacement():
            return next((p for p in world.pods() if _index(p) == 0 and p.metadata.name != leaving.metadata.name
                         and p.spec.node_name), None)
        joiner = await asyncio.to_thread(wait_until, replacement, 60, "the Job controller's replacement pod")
        assert joiner.spec.node_name not in (noticed, *survivors)
        await asyncio.to_thread(set_pod_running, plane, ns, joiner.metadata.name, "10.244.0.9", False)
        key = ("Job", ns, "train")
        await asyncio.to_thread(wait_until, lambda: (controller.cache.pods.get((ns, joiner.metadata.name)) or {})
                                .get("status", {}).get("phase") == "Running", 30, "the supervisor sees it Running")
        await controller.reconciler.reconcile(key)  # a pass that sees the joiner Running, not Ready
        told = await asyncio.to_thread(wait_until, lambda: _membership(world, joiner.metadata.name), 30,
                                       "the joiner told the membership")
        assert told == first  # it learns the group it is to join, which does not list it yet
        assert await asyncio.to_thread(survivors_told) == first

        await asyncio.to_thread(set_pod_running, plane, ns, joiner.metadata.name, "10.244.0.9", True)

        def grown():
            value = survivors_told()
            return value if value and value["generation"] > first["generation"] else None
        second = await asyncio.to_thread(wait_until, grown, 30, "the Ready joiner in the membership")
        assert second["hosts"] == [*survivors, joiner.spec.node_name]  # appended, not by completion index
        assert second["store"] == first["store"] and second["world_size"] == 4
        assert second["generation"] == first["generation"] + 1
        assert await asyncio.to_thread(_membership, world, joiner.metadata.name) == second

        job = await asyncio.to_thread(world.job)
        assert job["spec"]["parallelism"] == 4 and not job["spec"]["suspend"]
        for reason in (names.EVENT_SUSPENDED, names.EVENT_SCALED, names.EVENT_CHECKPOINTING):
            assert not await asyncio.to_thread(world.events, reason), reason
        assert not [c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == "Failed"]
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)
