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
    # As daemonset/examples/in-place-indexed-job.yaml: backoff per index. With one backoffLimit
    # the Job controller's re-creation delay (10 s, doubled per failure, Ignore'd ones included)
    # is the job's: 80 s before the 4 pods of a fallback come back, not 10.
    del job["spec"]["backoffLimit"]
    job["spec"].update(backoffLimitPerIndex=20, maxFailedIndexes=4)
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": names.ENV_RDZV_PORT, "value": PORT}]
    return job


def _index(pod) -> int:
    return int(pod.metadata.annotations[INDEX])


def _membership(world: World, name: str) -> dict | None:
    pod = world.core.read_namespaced_pod(name, world.ns)
    text = (pod.metadata.annotations or {}).get(names.ANN_MEMBERSHIP)
    return json.loads(text) if text else None


async def _running_in_place_job(plane, ns: str, job: dict | None = None) -> tuple[World, dict]:
    """4 nodes and the in-place Job's 4 pods (`job`, default `_in_place_job`) Running with IPs
    (the launcher's group, never asked to be Ready), by completion index."""
    world = World(plane, ns)
    for _ in range(4):
        await asyncio.to_thread(world.add_node)
    await asyncio.to_thread(world.batch.create_namespaced_job, ns, job or _in_place_job(ns))
    by_index = {_index(p): p for p in await asyncio.to_thread(world.running_on, 4)}
    for i, pod in by_index.items():
        await asyncio.to_thread(set_pod_running, plane, ns, pod.metadata.name, f"10.244.0.{i + 1}")
    return world, by_index


async def test_in_place_job_survives_a_notice_without_suspend_and_a_ready_replacement_joins(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world, by_index = await _running_in_place_job(plane, ns)
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


async def test_after_a_fallback_the_recreated_pods_get_their_own_membership_not_the_stale_one(
        control_plane, k8s_namespace, caplog):
    """Item 1 of issue 18, cluster side. After a notice the membership lists the 3 survivors; then
    the in-place change fails and every rank falls back (all 4 pods exit 83). The Job controller
    re-creates every index as a new pod (podFailurePolicy Ignore, restartPolicy Never). No
    re-created pod may be told the stale group (before: once the pods on the survivors' nodes ran,
    they were pushed a membership of those hosts, so the pod on the new node read one without its
    host and joined a group that no longer existed). Once all 4 run, the membership is the
    relaunched group: a new generation, every new pod's host in completion-index order, and index
    0's store, so every worker starts (the join rule: its host is listed)."""
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world, old = await _running_in_place_job(plane, ns)
    controller = _controller(plane, ns)
    await controller.start()
    try:
        noticed = old[0].spec.node_name
        await _mark(plane, noticed)

        def survivors_told():
            values = [_membership(world, old[i].metadata.name) for i in (1, 2, 3)]
            return values[0] if all(v == values[0] and v is not None for v in values) else None
        # (pushed after the record that names its member pods was written)
        first = await asyncio.to_thread(wait_until, survivors_told, 30, "the membership on the survivors")

        for pod in old.values():  # the fallback: every rank checkpoints and exits 83
            await asyncio.to_thread(set_container_exit, plane, ns, pod.metadata.name, names.EXIT_PREEMPTED)
        await asyncio.to_thread(world.add_node)  # room for index 0 off the noticed node
        old_names = {p.metadata.name for p in old.values()}

        def recreated():
            pods = [p for p in world.pods() if p.metadata.name not in old_names and p.spec.node_name]
            return pods if len(pods) == 4 else None
        new = {_index(p): p for p in await asyncio.to_thread(wait_until, recreated, 120, "4 re-created pods")}
        assert noticed not in {p.spec.node_name for p in new.values()}
        key = ("Job", ns, "train")

        def stale_told() -> list[str]:
            """Re-created pods told a membership that does not list their host."""
            out = []
            for pod in new.values():
                value = _membership(world, pod.metadata.name)
                if value is not None and pod.spec.node_name not in value["hosts"]:
                    out.append(f"{pod.metadata.name} on {pod.spec.node_name}: {value}")
            return out

        on_survivor_nodes = [i for i, p in new.items() if p.spec.node_name in first["hosts"]]
        others = [i for i in new if i not in on_survivor_nodes]
        assert others, "one re-created pod runs on the new node"
        for i in on_survivor_nodes:  # they run first, the pod on the new node still starts
            await asyncio.to_thread(set_pod_running, plane, ns, new[i].metadata.name, f"10.244.1.{i + 1}")
        await asyncio.to_thread(wait_until, lambda: all(
            (controller.cache.pods.get((ns, new[i].metadata.name)) or {}).get("status", {}).get("phase") == "Running"
            for i in on_survivor_nodes), 30, "the supervisor sees them Running")
        await controller.reconciler.reconcile(key)  # a pass over the partly relaunched job
        assert not stale_told()

        for i in others:
            await asyncio.to_thread(set_pod_running, plane, ns, new[i].metadata.name, f"10.244.1.{i + 1}")

        def fresh():
            values = [_membership(world, new[i].metadata.name) for i in range(4)]
            return values[0] if all(v == values[0] and v is not None for v in values) else None
        relaunched = await asyncio.to_thread(wait_until, fresh, 30, "the relaunched group's membership")
        assert relaunched["hosts"] == [new[i].spec.node_name for i in range(4)]
        assert relaunched["store"] == f"10.244.1.1:{PORT}" and relaunched["world_size"] == 4
        assert not stale_told()
        record = await asyncio.to_thread(world.record)
        # Newer than any membership of the old group (the supervisor may have seen some ranks exit
        # before the others and pushed the rest of the group meanwhile).
        assert relaunched["generation"] == record["generation"] > first["generation"]
        assert record["members"] == relaunched["hosts"] and len(record["member_pods"]) == 4
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)
