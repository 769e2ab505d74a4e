"""The supervisor against Kubeflow PyTorchJobs (kubeflow.org/v1) on the real kube-apiserver, as
its own ServiceAccount, through the admission policies of daemonset/base; the CRD comes from
tests/k8s_world.py (the published manifest cannot be fetched here).

There is no training operator here, so the test plays it (`PlayedOperator`, a thread): it
creates each replica type's pods from the PyTorchJob's current template, with the labels and
the controller owner reference the operator sets, deletes them while `runPolicy.suspend` is
true, and deletes the workers above `Worker.replicas`. It notices changes by polling, so, like
a real operator reconciling from a queue, it may never see a state that lasted only a moment.
It plays the kubelet too: a bound pod is marked Running. The notices are written on the Nodes
by the agent's own NodeMarker as spotguard-agent; exit codes go through `pods/status`."""
from __future__ import annotations

import asyncio
import json
import logging
import threading

import kubernetes
import pytest

from spotguard.agent.node_marker import NodeMarker
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.jobs.pytorch import REPLICA_TYPE_LABEL
from spotguard.kube.api import Kube
from spotguard.supervisor.policy import Settings
from spotguard.supervisor.record import parse_record
from spotguard.wire import names
from spotguard.wire.notice import Kind
from tests.k8s_world import (add_ready_node, install_pytorchjob_crd, refusals, set_container_exit, set_pod_running,
                             wait_service_account, wait_until)
from tests.test_node_marker import make_notice

pytestmark = pytest.mark.k8s

CRD_ARGS = ("kubeflow.org", "v1")
PLURAL = "pytorchjobs"
JOB = "pt"
POOL = "spotguard-test/pool"  # each test's pods fit only on that test's nodes
CAPACITY = "karpenter.sh/capacity-type"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


def _template(selector: dict) -> dict:
    return {"spec": {"terminationGracePeriodSeconds": 0, "nodeSelector": selector,
                     "containers": [{"name": "pytorch", "image": "train:1",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def _pytorchjob(workers: int, annotations: dict, selector: dict, master: bool = False,
                elastic: dict | None = None) -> dict:
    specs = {"Worker": {"replicas": workers, "restartPolicy": "OnFailure", "template": _template(selector)}}
    if master:
        specs["Master"] = {"replicas": 1, "restartPolicy": "OnFailure", "template": _template(selector)}
    spec: dict = {"runPolicy": {"suspend": False, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": specs}
    if elastic:
        spec["elasticPolicy"] = elastic
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": JOB, "labels": {names.LABEL_MANAGED: "true"}, "annotations": annotations},
            "spec": spec}


class PlayedOperator:
    """The training operator's and the kubelet's parts for one PyTorchJob (module docstring).
    Runs in its own thread from `start()`; `stop()` joins it and raises what it hit."""

    def __init__(self, plane, namespace: str, interval: float = 0.3):
        api = plane.api_client()
        self.plane, self.ns, self.interval = plane, namespace, interval
        self.core, self.custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="played-operator", daemon=True)
        self.errors: list[BaseException] = []

    def start(self) -> PlayedOperator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the played operator did not stop"
        assert not self.errors, self.errors

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.reconcile()
            except kubernetes.client.ApiException as exc:
                if exc.status not in (404, 409):  # a pod gone or made since the list: next round
                    self.errors.append(exc)
                    return
            except Exception as exc:  # surfaced by stop()
                self.errors.append(exc)
                return

    def reconcile(self) -> None:
        job = self.custom.get_namespaced_custom_object(*CRD_ARGS, self.ns, PLURAL, JOB)
        pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(
            self.ns, label_selector=f"{JOB_NAME_LABEL}={JOB}").items}
        wanted: dict[str, tuple[str, int, dict]] = {}
        if not (job["spec"].get("runPolicy") or {}).get("suspend"):
            for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
                for index in range(spec.get("replicas", 1)):
                    wanted[f"{JOB}-{role.lower()}-{index}"] = (role, index, spec["template"])
        for name, pod in pods.items():
            if name not in wanted:
                self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
            elif pod.spec.node_name and pod.status.phase == "Pending":
                set_pod_running(self.plane, self.ns, name)
        for name, (role, index, template) in wanted.items():
            if name not in pods:
                self.core.create_namespaced_pod(self.ns, self._pod(job, name, role, index, template))

    @staticmethod
    def _pod(job: dict, name: str, role: str, index: int, template: dict) -> dict:
        labels = {**(template.get("metadata") or {}).get("labels", {}), JOB_NAME_LABEL: JOB,
                  "training.kubeflow.org/operator-name": "pytorchjob-controller",
                  REPLICA_TYPE_LABEL: role.lower(), REPLICA_INDEX_LABEL: str(index)}
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": JOB, "uid": job["metadata"]["uid"],
                 "controller": True, "blockOwnerDeletion": True}
        spec = {**template["spec"], "restartPolicy": "OnFailure"}
        return {"metadata": {"name": name, "labels": labels, "ownerReferences": [owner]}, "spec": spec}


class World:
    """The admin's view of one test's namespace: its nodes, the PyTorchJob and its pods."""

    def __init__(self, plane, namespace: str):
        self.plane, self.ns = plane, namespace
        api = plane.api_client()
        self.core, self.custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        self.nodes: list[str] = []

    def add_nodes(self, count: int, labels: dict | None = None, gpus: int = 1) -> list[str]:
        """Adds `count` Ready nodes of this test's pool at once (threads: each waits for its taint)."""
        names_ = [f"{self.ns}-n{len(self.nodes) + i}" for i in range(count)]
        self.nodes += names_
        threads = [
            threading.Thread(target=add_ready_node, args=(self.plane, n, {POOL: self.ns, **(labels or {})}, gpus))
            for n in names_]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return names_

    def create(self, body: dict) -> None:
        self.custom.create_namespaced_custom_object(*CRD_ARGS, self.ns, PLURAL, body)
        # the operator's own condition, through the status subresource: the supervisor must keep it
        self.custom.patch_namespaced_custom_object_status(*CRD_ARGS, self.ns, PLURAL, JOB, {"status": {"conditions": [
            {"type": "Created", "status": "True", "reason": "PyTorchJobCreated", "message": "created"}]}})

    def job(self) -> dict:
        return self.custom.get_namespaced_custom_object(*CRD_ARGS, self.ns, PLURAL, JOB)

    def record(self):
        return parse_record((self.job()["metadata"].get("annotations") or {}).get(names.ANN_STATUS))

    def workers(self) -> int:
        return self.job()["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]

    def suspended(self) -> bool:
        return bool(self.job()["spec"]["runPolicy"].get("suspend"))

    def pods(self, role: str = "worker") -> list:
        return self.core.list_namespaced_pod(self.ns, label_selector=f"{JOB_NAME_LABEL}={JOB},"
                                             f"{REPLICA_TYPE_LABEL}={role}").items

    def running(self, count: int, nodes: set[str] | None = None, role: str = "worker") -> list:
        """The `role` pods when exactly `count` run (on `nodes`, when given), else []."""
        pods = [p for p in self.pods(role) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return pods if len(pods) == count and all(nodes is None or p.spec.node_name in nodes for p in pods) else []

    def conditions(self) -> dict:
        return {c["type"]: c for c in (self.job().get("status") or {}).get("conditions") or []}

    def event_reasons(self) -> set[str]:
        return {e.reason for e in self.core.list_namespaced_event(self.ns).items}

    def cleanup(self) -> None:
        for node in self.nodes:
            self.core.delete_node(node)


class Agents:
    """The agent's NodeMarker on each noticed node, as spotguard-agent (marks kept until cleared)."""

    def __init__(self, plane):
        self.plane = plane
        self.markers: dict[str, NodeMarker] = {}

    async def notice(self, node: str) -> None:
        marker = NodeMarker(self.plane.client_as("spotguard-agent"), node, event_pods=False)
        await marker.start()
        self.markers[node] = marker
        marker.notify([make_notice(Kind.RECLAIM, 120, "r", node=node)])
        await asyncio.to_thread(wait_until, lambda: marker.in_sync, 20, f"{node} marked")

    async def withdraw(self, node: str) -> None:
        marker = self.markers[node]
        marker.notify([])
        await asyncio.to_thread(wait_until, lambda: marker.in_sync, 20, f"{node} unmarked")

    async def stop(self) -> None:
        for marker in self.markers.values():
            await marker.stop()


def _controller(plane, namespace: str, **config) -> Controller:
    config = ControllerConfig(**{"identity": "sup-pytorchjob", "namespace": namespace, "resync": 5.0,
                                 "settings": Settings(checkpoint_timeout=60.0, scale_out_delay=0.2), **config})
    return Controller(Kube(plane.client_as("spotguard-supervisor")), config)


def _clean(controller: Controller, caplog) -> None:
    """Every write of the supervisor was accepted: no failed reconcile, no 403/415/422 logged."""
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and r.levelno >= logging.WARNING]
    assert not failed and not refusals(caplog), failed or refusals(caplog)
    errors = [line for line in controller.metrics.render().splitlines()
              if line.startswith("spotguard_supervisor_errors_total") and not line.endswith(" 0")]
    assert not errors, errors


@pytest.fixture
def world(control_plane, k8s_namespace):
    install_pytorchjob_crd(control_plane)
    wait_service_account(control_plane, k8s_namespace)  # the played operator's pods need it
    world = World(control_plane, k8s_namespace)
    try:
        yield world
    finally:
        world.cleanup()


async def test_elastic_policy_scales_pytorchjob_workers(control_plane, world, caplog):
    caplog.set_level(logging.INFO)
    await asyncio.to_thread(world.add_nodes, 4)
    world.create(_pytorchjob(4, {names.ANN_POLICY: "elastic"}, {POOL: world.ns},
                             elastic={"minReplicas": 2, "maxReplicas": 4}))
    operator, agents = PlayedOperator(control_plane, world.ns).start(), Agents(control_plane)
    controller = _controller(control_plane, world.ns)
    try:
        pods = await asyncio.to_thread(wait_until, lambda: world.running(4), 60, "4 workers running")
        await controller.start()
        # the notice hits worker 3's node: the operator removes the highest index on a scale-in
        noticed = next(p.spec.node_name for p in pods if p.metadata.name == f"{JOB}-worker-3")
        await agents.notice(noticed)
        await asyncio.to_thread(wait_until, lambda: world.workers() == 3, 30, "Worker.replicas 4 -> 3")
        # the Event follows the pass's one patch: wait for it rather than read it with the patch
        await asyncio.to_thread(wait_until, lambda: names.EVENT_SCALED in world.event_reasons(), 30, "the Scaled Event")
        assert world.record().phase == "Running"
        assert world.job()["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4}

        def membership_pushed():
            pods = world.running(3)
            values = [json.loads((p.metadata.annotations or {}).get(names.ANN_MEMBERSHIP, "null")) for p in pods]
            return pods and all(v and v == values[0] and noticed not in v["hosts"] and v["world_size"] == 3
                                for v in values)
        await asyncio.to_thread(wait_until, membership_pushed, 30, "membership of the 3 workers")

        await asyncio.to_thread(world.add_nodes, 1)  # capacity returns
        await asyncio.to_thread(wait_until, lambda: world.workers() == 4, 30, "Worker.replicas 3 -> 4")
        healthy = set(world.nodes) - {noticed}
        await asyncio.to_thread(wait_until, lambda: world.running(4, healthy), 30, "4 workers off the noticed node")
    finally:
        await controller.stop()
        await agents.stop()
        operator.stop()
    _clean(controller, caplog)


async def test_fixed_policy_suspends_pytorchjob_after_exit_83_and_resumes(control_plane, world, caplog):
    caplog.set_level(logging.INFO)
    await asyncio.to_thread(world.add_nodes, 4)
    world.create(_pytorchjob(4, {names.ANN_POLICY: "fixed"}, {POOL: world.ns}))
    operator, agents = PlayedOperator(control_plane, world.ns).start(), Agents(control_plane)
    controller = _controller(control_plane, world.ns)
    try:
        pods = await asyncio.to_thread(wait_until, lambda: world.running(4), 60, "4 workers running")
        await controller.start()
        drained = pods[0]
        await agents.notice(drained.spec.node_name)
        await asyncio.to_thread(wait_until, lambda: world.record().phase == "Checkpointing", 30, "checkpoint wait")
        assert not world.suspended()  # never before the checkpoint is durable
        await asyncio.to_thread(set_container_exit, control_plane, world.ns, drained.metadata.name,
                                names.EXIT_PREEMPTED)
        await asyncio.to_thread(wait_until, lambda: world.suspended() and world.record().phase == "Suspended", 30,
                                "runPolicy.suspend set")
        await asyncio.to_thread(wait_until, lambda: not world.pods(), 30, "the operator removed the pods")
        conditions = await asyncio.to_thread(wait_until, lambda: names.COND_SUSPENDED in world.conditions()
                                             and world.conditions(), 15, "the supervisor's condition (status)")
        assert conditions[names.COND_SUSPENDED]["status"] == "True" and "Created" in conditions

        await asyncio.to_thread(world.add_nodes, 1)  # 4 nodes without a notice again
        await asyncio.to_thread(wait_until, lambda: not world.suspended() and world.record().phase == "Running", 30,
                                "resumed")
        assert world.workers() == 4 and names.EVENT_RESUMED in world.event_reasons()
        healthy = set(world.nodes) - {drained.spec.node_name}
        await asyncio.to_thread(wait_until, lambda: world.running(4, healthy), 30, "4 workers off the noticed node")
        await asyncio.to_thread(wait_until, lambda: world.conditions()[names.COND_SUSPENDED]["status"] == "False", 15,
                                "condition cleared")
    finally:
        await controller.stop()
        await agents.stop()
        operator.stop()
    _clean(controller, caplog)


def _drain(plane, world: World, pods: list) -> None:
    """Each replica exits 83 after its checkpoint, reporting 0 steps lost, and the kubelet
    restarts it in place (restartPolicy OnFailure). The supervisor acts on the first replica's
    exit (all ranks checkpointed one agreed step), so the operator may delete the others before
    their exits are written: a pod gone (or made again) by then has nothing left to report."""
    for pod in pods:
        try:
            set_container_exit(plane, world.ns, pod.metadata.name, names.EXIT_PREEMPTED, restarted=True,
                               message=json.dumps({"v": 1, "steps_lost": 0}), uid=pod.metadata.uid)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise


def _selectors(job: dict) -> dict[str, dict]:
    return {role: spec["template"]["spec"]["nodeSelector"] for role, spec in job["spec"]["pytorchReplicaSpecs"].items()}


async def test_fallback_moves_a_pytorchjob_to_on_demand_and_back_to_spot(control_plane, world, caplog):
    caplog.set_level(logging.INFO)
    spot = set(await asyncio.to_thread(world.add_nodes, 2, {CAPACITY: "spot"}, 2))
    on_demand = set(await asyncio.to_thread(world.add_nodes, 2, {CAPACITY: "on-demand"}, 2))
    world.create(_pytorchjob(2, {names.ANN_FALLBACK: "on-demand", names.ANN_FALLBACK_AFTER: "2s",
                                 names.ANN_RETURN_AFTER: "2s"}, {CAPACITY: "spot", POOL: world.ns}, master=True))
    operator, agents = PlayedOperator(control_plane, world.ns).start(), Agents(control_plane)
    controller = _controller(control_plane, world.ns, cost_interval=0.2, cost_save_interval=0.5,
                             settings=Settings(checkpoint_timeout=30.0))
    sup = kubernetes.client.CustomObjectsApi(control_plane.client_as("spotguard-supervisor"))
    try:
        def on(nodes: set[str]) -> list:
            workers, master = world.running(2, nodes), world.running(1, nodes, role="master")
            return workers + master if workers and master else []

        await asyncio.to_thread(wait_until, lambda: on(spot), 60, "master and workers on spot nodes")
        # A strategic-merge patch, which kmock took, is refused for a custom resource: the
        # supervisor's writes must be JSON merge patches (spotguard/kube/api.py).
        with pytest.raises(kubernetes.client.ApiException) as refused:
            sup.patch_namespaced_custom_object(*CRD_ARGS, world.ns, PLURAL, JOB, {"metadata": {"annotations": {
                names.ANN_STATUS: "{}"}}}, _content_type="application/strategic-merge-patch+json")
        assert refused.value.status == 415
        await controller.start()

        for node in spot:  # spot capacity goes away
            await agents.notice(node)
        await asyncio.to_thread(wait_until, lambda: world.record().phase == "Checkpointing", 15, "checkpoint wait")
        await asyncio.to_thread(_drain, control_plane, world, on(spot))
        await asyncio.to_thread(wait_until, lambda: on(on_demand), 30, "master and workers on on-demand nodes")
        assert _selectors(world.job()) == {
            role: {CAPACITY: "on-demand", POOL: world.ns} for role in ("Master", "Worker")}
        assert world.record().capacity == "on-demand"
        conditions = await asyncio.to_thread(wait_until, lambda: names.COND_ON_DEMAND in world.conditions()
                                             and world.conditions(), 15, "SpotguardOnDemand condition")
        assert conditions[names.COND_ON_DEMAND]["status"] == "True" and "Created" in conditions

        for node in spot:  # spot capacity comes back
            await agents.withdraw(node)

        def drain_requested():
            pods = world.running(2, on_demand)
            values = [json.loads((p.metadata.annotations or {}).get(names.ANN_MEMBERSHIP, "{}")) for p in pods]
            return pods if pods and all(v.get("drain") for v in values) else []

        asked = await asyncio.to_thread(wait_until, drain_requested, 30, "drain request to the workers")
        await asyncio.to_thread(_drain, control_plane, world, asked)
        await asyncio.to_thread(wait_until, lambda: on(spot), 30, "master and workers back on spot nodes")
        assert _selectors(world.job()) == {role: {CAPACITY: "spot", POOL: world.ns} for role in ("Master", "Worker")}

        def settled():
            job, conditions = world.job(), world.conditions()
            return (job["metadata"]["annotations"].get(names.ANN_STEPS_LOST) == "0"
                    and (conditions.get(names.COND_ON_DEMAND) or {}).get("reason") == "ReturnedToSpot")
        await asyncio.to_thread(wait_until, settled, 15, "steps-lost annotation and condition")
        assert {names.EVENT_FELL_BACK, names.EVENT_RETURNING, names.EVENT_RETURNED} <= world.event_reasons()
        assert controller.ledger.jobs[("PyTorchJob", world.ns, JOB)].on_demand_hours > 0
    finally:
        await controller.stop()
        await agents.stop()
        operator.stop()
    _clean(controller, caplog)
