"""Prefer spot, fall back to on-demand, come back: the supervisor, as its own ServiceAccount,
against the real kube-apiserver, Job controller and scheduler (tests/control_plane.py).

The test plays the parts that need a kubelet: it marks pods Running, and, as the Guard would,
writes exit 83 with the termination message `{"steps_lost": 0}` once a replica is asked to
drain (a node notice, or the `drain` in the membership annotation for the return)."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta, UTC

import kubernetes
import pytest

from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.kube.api import Kube
from spotguard.supervisor.policy import Settings
from spotguard.supervisor.record import parse_record
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice
from tests.k8s_world import add_ready_node, wait_until

pytestmark = pytest.mark.k8s

CAPACITY = "karpenter.sh/capacity-type"
POOL = "spotguard-test/pool"
FALLBACK_AFTER = RETURN_AFTER = 2.0
MARGIN = 5.0


def _job(pool: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": {names.ANN_FALLBACK: "on-demand", names.ANN_FALLBACK_AFTER: "2s",
                                         names.ANN_RETURN_AFTER: "2s"}},
            "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed", "backoffLimit": 6,
                     "template": {"spec": {
                         "restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 0,
                         "nodeSelector": {CAPACITY: "spot", POOL: pool},
                         "containers": [{"name": "train", "image": "train:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


class World:
    """The admin's view of the namespace, and the kubelet's and Guard's parts."""

    def __init__(self, plane, namespace: str):
        self.plane, self.ns = plane, namespace
        api = plane.api_client()
        self.core, self.batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)

    def pods(self) -> list:
        return self.core.list_namespaced_pod(self.ns, label_selector="batch.kubernetes.io/job-name=train").items

    def active_on(self, nodes: set[str]) -> list:
        pods = [p for p in self.pods() if p.status.phase not in ("Succeeded", "Failed")
                and not p.metadata.deletion_timestamp]
        return pods if len(pods) == 2 and all(p.spec.node_name in nodes for p in pods) else []

    def run(self, pods: list) -> None:
        for pod in pods:
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": {"phase": "Running"}})

    def drain(self, pods: list, steps_lost: int = 0) -> None:
        """Each replica exits 83 after its checkpoint, reporting the steps it lost; the kubelet
        restarts the container in place (`restartPolicy: OnFailure`): no failed pod, so the Job
        controller's failure backoff (10 s, doubling) does not delay the move."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pod in pods:
            term = {"exitCode": names.EXIT_PREEMPTED, "reason": "Error", "startedAt": now, "finishedAt": now,
                    "message": json.dumps({"v": 1, "steps_lost": steps_lost})}
            container = {"name": "train", "image": "train:1", "imageID": "", "ready": False, "restartCount": 1,
                         "lastState": {"terminated": term}, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": {
                "phase": "Running", "containerStatuses": [container]}})

    def mark(self, node: str, notice: Notice | None) -> None:
        """The agent's marks: the notice annotation and the reclaim taint (or their removal)."""
        taints = [t for t in (self.core.read_node(node).spec.taints or []) if t.key != names.TAINT_RECLAIM]
        body_taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in taints]
        if notice is not None:
            body_taints.append({"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"})
        annotations = {names.ANN_NOTICE: notice.to_json() if notice else None}
        self.core.patch_node(node, {"metadata": {"annotations": annotations}, "spec": {"taints": body_taints}})

    def job(self) -> dict:
        return self.plane.api_client().sanitize_for_serialization(self.batch.read_namespaced_job("train", self.ns))

    def record(self):
        return parse_record((self.job()["metadata"].get("annotations") or {}).get(names.ANN_STATUS))

    def event_reasons(self) -> set[str]:
        return {e.reason for e in self.core.list_namespaced_event(self.ns).items}


def _controller(plane, namespace: str) -> Controller:
    config = ControllerConfig(identity="supervisor-test", namespace=namespace, resync=5.0, cost_interval=0.2,
                              cost_save_interval=0.5, settings=Settings(checkpoint_timeout=30.0))
    return Controller(Kube(plane.client_as("spotguard-supervisor")), config)


async def test_fallback_to_on_demand_and_return_to_spot(control_plane, k8s_namespace):
    world = World(control_plane, k8s_namespace)
    pool = k8s_namespace
    spot = {add_ready_node(control_plane, f"{pool}-spot-{i}", {CAPACITY: "spot", POOL: pool}) for i in (1, 2)}
    on_demand = {add_ready_node(control_plane, f"{pool}-od-{i}", {CAPACITY: "on-demand", POOL: pool}) for i in (1, 2)}
    world.batch.create_namespaced_job(k8s_namespace, _job(pool))
    world.run(await asyncio.to_thread(wait_until, lambda: world.active_on(spot), 60, "replicas on spot nodes"))

    controller = _controller(control_plane, k8s_namespace)
    await controller.start()
    try:
        # spot capacity goes away: both spot nodes get a reclaim notice
        notices = {n: Notice(id=f"aws.spot:{n}", kind=Kind.RECLAIM, source="aws.spot", node=n,
                             detected_at=datetime.now(UTC),
                             deadline=datetime.now(UTC) + timedelta(minutes=2)) for n in spot}
        gone_at = time.monotonic()
        for node, notice in notices.items():
            await asyncio.to_thread(world.mark, node, notice)
        await asyncio.to_thread(wait_until, lambda: world.record().phase == "Checkpointing", 10, "checkpoint wait")
        await asyncio.to_thread(world.drain, world.active_on(spot))
        moved = await asyncio.to_thread(wait_until, lambda: world.active_on(on_demand),
                                        FALLBACK_AFTER + MARGIN + 30, "replicas on on-demand nodes")
        fallback_seconds = time.monotonic() - gone_at
        world.run(moved)
        job = world.job()
        assert job["spec"]["template"]["spec"]["nodeSelector"] == {CAPACITY: "on-demand", POOL: pool}
        assert world.record().capacity == "on-demand"
        print(f"fallback: notice -> replicas bound on on-demand nodes {fallback_seconds:.2f}s")
        assert fallback_seconds <= FALLBACK_AFTER + MARGIN, fallback_seconds

        await asyncio.sleep(1.0)  # on-demand node-hours accrue
        # spot capacity comes back
        back_at = time.monotonic()
        for node in spot:
            await asyncio.to_thread(world.mark, node, None)

        def drain_requested():
            pods = world.active_on(on_demand)
            values = [json.loads((p.metadata.annotations or {}).get(names.ANN_MEMBERSHIP, "{}")) for p in pods]
            return pods if pods and all(v.get("drain") for v in values) else []

        asked = await asyncio.to_thread(wait_until, drain_requested, RETURN_AFTER + MARGIN + 30, "drain request")
        await asyncio.to_thread(world.drain, asked)
        returned = await asyncio.to_thread(wait_until, lambda: world.active_on(spot), RETURN_AFTER + MARGIN + 30,
                                           "replicas back on spot nodes")
        return_seconds = time.monotonic() - back_at
        world.run(returned)
        job = world.job()
        assert job["spec"]["template"]["spec"]["nodeSelector"] == {CAPACITY: "spot", POOL: pool}
        print(f"return: spot capacity back -> replicas bound on spot nodes {return_seconds:.2f}s")
        assert return_seconds <= RETURN_AFTER + MARGIN, return_seconds

        def settled():
            job = world.job()
            conds = {c["type"]: c for c in job["status"].get("conditions") or []}
            on_demand_cond = conds.get(names.COND_ON_DEMAND) or {}
            return (job["metadata"]["annotations"].get(names.ANN_STEPS_LOST) == "0"
                    and on_demand_cond.get("reason") == "ReturnedToSpot" and job)

        await asyncio.to_thread(wait_until, settled, 15, "steps-lost annotation and conditions")
        reasons = await asyncio.to_thread(world.event_reasons)
        assert {names.EVENT_FELL_BACK, names.EVENT_RETURNING, names.EVENT_RETURNED} <= reasons
        assert "spotguard_job_on_demand_node_hours{" in controller.metrics.render()
        hours = controller.ledger.jobs[("Job", k8s_namespace, "train")].on_demand_hours
        assert hours * 3600 >= 1.0
        await asyncio.to_thread(wait_until, lambda: (world.record().cost or {}).get("on_demand_hours", 0) > 0, 10,
                                "cost totals saved in the record")
    finally:
        await controller.stop()

    # a new supervisor starts from the saved totals, not from zero
    saved = world.record().cost
    successor = _controller(control_plane, k8s_namespace)
    await successor.start()
    try:
        entry = successor.ledger.jobs[("Job", k8s_namespace, "train")]
        assert entry.on_demand_hours >= saved["on_demand_hours"] > 0
        assert world.record().steps_lost == 0
    finally:
        await successor.stop()
