"""The supervisor against a real kube-apiserver, as its own ServiceAccount (spotguard-supervisor):
fixed and elastic policies on Indexed Jobs whose pods the real Job controller creates and the
real scheduler binds to Ready nodes; the notice written on the Node by the agent's own marker
(as spotguard-agent); exit codes written through `pods/status` as a kubelet would. And leader
election on the supervisor's Lease. tests/test_supervisor_controller.py covers the rest on kmock
(restarts mid-decision, malformed annotations); PyTorchJobs on the real server: test_k8s_pytorchjob.py."""
from __future__ import annotations

import asyncio
import json
import logging

import kubernetes
import pytest

from spotguard.agent.node_marker import NodeMarker
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.kube.api import LEASES, Kube
from spotguard.supervisor.leader import LeaderElector
from spotguard.supervisor.policy import Settings
from spotguard.wire import names
from spotguard.wire.notice import Kind
from tests.k8s_world import add_ready_node, refusals, set_container_exit, set_pod_running, wait_until
from tests.test_node_marker import make_notice

pytestmark = pytest.mark.k8s
SUPERVISOR = "spotguard-supervisor"
POOL = "spotguard-test/pool"  # each test's Job only fits on that test's nodes


def _job(name: str, pool: str, replicas: int, annotations: dict) -> dict:
    template = {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                         "nodeSelector": {POOL: pool},
                         "containers": [{"name": "train", "image": "train:1",
                                         "resources": {"requests": {"nvidia.com/gpu": "1"},
                                                       "limits": {"nvidia.com/gpu": "1"}}}]}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {names.LABEL_MANAGED: "true"}, "annotations": annotations},
            "spec": {"parallelism": replicas, "completions": replicas, "completionMode": "Indexed",
                     "backoffLimit": 10, "template": template}}


class World:
    """One test's nodes and Job in its namespace; blocking helpers (run them in threads)."""

    def __init__(self, plane, namespace: str):
        self.plane, self.ns = plane, namespace
        self.core = kubernetes.client.CoreV1Api(plane.api_client())
        self.batch = kubernetes.client.BatchV1Api(plane.api_client())
        self.nodes: list[str] = []

    def add_node(self) -> str:
        name = add_ready_node(self.plane, f"{self.ns}-n{len(self.nodes)}", labels={POOL: self.ns})
        self.nodes.append(name)
        return name

    def pods(self) -> list:
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector="job-name=train").items
                if not p.metadata.deletion_timestamp and p.status.phase not in ("Succeeded", "Failed")]

    def running_on(self, count: int, avoid: str | None = None) -> list:
        """Waits for `count` pods of the Job bound to nodes (never `avoid`), marks them Running."""
        def placed():
            pods = self.pods()
            return pods if len(pods) == count and all(p.spec.node_name and p.spec.node_name != avoid
                                                      for p in pods) else None
        pods = wait_until(placed, 60, f"{count} pods bound")
        for pod in pods:
            if pod.status.phase != "Running":
                set_pod_running(self.plane, self.ns, pod.metadata.name)
        return pods

    def job(self) -> dict:
        return self.batch.read_namespaced_job("train", self.ns).to_dict()

    def record(self) -> dict:
        text = (self.job()["metadata"]["annotations"] or {}).get(names.ANN_STATUS)
        return json.loads(text) if text else {}

    def job_is(self, parallelism: int, suspend: bool, phase: str) -> bool:
        spec = self.job()["spec"]
        return (spec["parallelism"], bool(spec["suspend"]), self.record().get("phase")) == (parallelism, suspend, phase)

    def events(self, reason: str) -> list:
        return [e for e in self.core.list_namespaced_event(self.ns, field_selector="involvedObject.name=train").items
                if e.reason == reason]

    def cleanup(self) -> None:
        for node in self.nodes:
            self.core.delete_node(node)


async def _mark(plane, node: str) -> None:
    """The agent marks the Node with a reclaim notice (its own marker, as its own ServiceAccount)."""
    marker = NodeMarker(plane.client_as("spotguard-agent"), node, event_pods=False)
    await marker.start()
    try:
        marker.notify([make_notice(Kind.RECLAIM, 120, "r", node=node)])
        await asyncio.to_thread(wait_until, lambda: marker.in_sync, 20, f"{node} marked")
    finally:
        await marker.stop()  # the marks stay


def _controller(plane, namespace: str) -> Controller:
    config = ControllerConfig(identity="sup-k8s", namespace=namespace, resync=30.0, workers=2,
                              settings=Settings(checkpoint_timeout=60.0, scale_out_delay=0.2))
    return Controller(Kube(plane.client_as(SUPERVISOR)), config)


async def _policy_world(plane, namespace: str, annotations: dict) -> World:
    world = World(plane, namespace)
    for _ in range(4):
        await asyncio.to_thread(world.add_node)
    await asyncio.to_thread(world.batch.create_namespaced_job, namespace, _job("train", namespace, 4, annotations))
    await asyncio.to_thread(world.running_on, 4)
    return world


# torchrun exits 1 when its worker drains with 83: the message the ranks wrote says they drained
TORCHRUN_DRAIN = (1, json.dumps({"v": 1, "notice_id": "aws.spot:r", "step": 40, "saved_step": 40, "steps_lost": 0,
                                 "checkpoint": "durable"}))


@pytest.mark.parametrize("drain", [(names.EXIT_PREEMPTED, ""), TORCHRUN_DRAIN], ids=["exit-83", "torchrun-exit-1"])
async def test_fixed_policy_suspends_after_the_checkpoint_and_resumes_on_capacity(control_plane, k8s_namespace,
                                                                                    caplog, drain):
    caplog.set_level(logging.INFO)
    world = await _policy_world(control_plane, k8s_namespace, {names.ANN_POLICY: "fixed"})
    controller = _controller(control_plane, k8s_namespace)
    await controller.start()
    try:
        noticed = world.nodes[0]
        await _mark(control_plane, noticed)
        await asyncio.to_thread(wait_until, lambda: world.record().get("phase") == "Checkpointing", 30,
                                "waiting for the checkpoint")
        assert world.job()["spec"]["suspend"] is not True  # never before the checkpoint is durable
        drained = next(p for p in world.pods() if p.spec.node_name == noticed)
        await asyncio.to_thread(set_container_exit, control_plane, k8s_namespace, drained.metadata.name,
                                drain[0], message=drain[1])
        await asyncio.to_thread(wait_until, lambda: world.job_is(4, True, "Suspended"), 30, "job suspended")
        await asyncio.to_thread(wait_until, lambda: not world.pods(), 30, "the Job controller removed the pods")
        await asyncio.to_thread(wait_until, lambda: world.events(names.EVENT_SUSPENDED), 30, "the Event")

        await asyncio.to_thread(world.add_node)  # capacity returns: 4 nodes without a notice
        await asyncio.to_thread(wait_until, lambda: world.job_is(4, False, "Running"), 30, "job resumed")
        await asyncio.to_thread(world.running_on, 4, noticed)  # the scheduler keeps off the tainted node
        await asyncio.to_thread(wait_until, lambda: world.events(names.EVENT_RESUMED), 30, "the Event")
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)


async def test_elastic_policy_scales_in_on_a_notice_and_out_on_capacity(control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    world = await _policy_world(control_plane, k8s_namespace,
                                {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2"})
    controller = _controller(control_plane, k8s_namespace)
    await controller.start()
    try:
        noticed = world.nodes[0]
        await _mark(control_plane, noticed)
        await asyncio.to_thread(wait_until, lambda: world.job_is(3, False, "Running"), 30, "scaled 4 -> 3")
        # The Event follows the patch (the decision's effects): waited for, not raced.
        await asyncio.to_thread(wait_until, lambda: world.events(names.EVENT_SCALED), 30, "the Event of the scale")

        def membership_pushed():
            values = [json.loads((p.metadata.annotations or {}).get(names.ANN_MEMBERSHIP, "null") or "null")
                      for p in world.pods() if p.spec.node_name != noticed and p.status.phase == "Running"]
            # The Job controller, not the supervisor, picks which pod goes on a scale-in (mostly the
            # noticed one here, not always): the members are whatever runs on unaffected nodes.
            # A pod not told yet has none: not yet, rather than an error.
            return values and all(v is not None and v == values[0] and noticed not in v["hosts"]
                                  and v["world_size"] == len(v["hosts"]) >= 2 for v in values)
        await asyncio.to_thread(wait_until, membership_pushed, 30, "membership on the surviving pods")

        await asyncio.to_thread(world.add_node)
        await asyncio.to_thread(wait_until, lambda: world.job_is(4, False, "Running"), 30, "scaled 3 -> 4")
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)


async def test_leader_election_on_the_supervisor_lease(control_plane, caplog):
    """Two candidates as spotguard-supervisor on its Lease (the only one its Role lets it write):
    one leads; when it stops renewing (crash: no release), the other takes over after the lease
    duration; a clean stop releases it."""
    caplog.set_level(logging.INFO)

    def candidate(identity: str) -> LeaderElector:
        return LeaderElector(Kube(control_plane.client_as(SUPERVISOR)), "spotguard", SUPERVISOR, identity,
                             lease_duration=2.0, renew_period=0.2)

    a, b = candidate("sup-a"), candidate("sup-b")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    await asyncio.sleep(0.5)
    run_b = asyncio.create_task(b.run(stop_b))
    try:
        await asyncio.to_thread(wait_until, a.is_leader, 10, "sup-a leads")
        await asyncio.sleep(1.0)
        assert a.is_leader() and not b.is_leader()
        run_a.cancel()  # sup-a dies without releasing the lease
        await asyncio.gather(run_a, return_exceptions=True)
        await asyncio.to_thread(wait_until, b.is_leader, 15, "sup-b takes over")
        lease = await asyncio.to_thread(Kube(control_plane.api_client()).get, LEASES, "spotguard", SUPERVISOR)
        assert lease["spec"]["holderIdentity"] == "sup-b" and lease["spec"]["leaseTransitions"] >= 1
        assert not a.is_leader()
        stop_b.set()
        await asyncio.wait_for(run_b, 10)
        lease = await asyncio.to_thread(Kube(control_plane.api_client()).get, LEASES, "spotguard", SUPERVISOR)
        assert not lease["spec"].get("holderIdentity")  # released on a clean stop
    finally:
        for task in (run_a, run_b):
            task.cancel()
        await asyncio.gather(run_a, run_b, return_exceptions=True)
    assert not refusals(caplog)
