"""Backfill on the real kube-apiserver (tests/control_plane.py; real Job controller and scheduler,
no kubelet): one Indexed Job holds spot and on-demand pods. Its template admits both capacity
types and carries the `spotguard.io/capacity` scheduling gate; the supervisor, as its own
ServiceAccount (RBAC and admission policies of daemonset/base), places each gated pod: on spot
at once while spot slots are free, on on-demand once the job has been below max for
`fallback-after`. The job reaches max within fallback-after + 10 s, and never on-demand sooner."""
from __future__ import annotations

import asyncio
import time

import kubernetes
import pytest

from spotguard.kube.api import Kube
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.placement import GATE
from spotguard.supervisor.policy import Settings
from spotguard.supervisor.record import parse_record
from spotguard.wire import names
from tests.k8s_world import add_ready_node, set_pod_running, wait_until

pytestmark = pytest.mark.k8s

CAPACITY = "karpenter.sh/capacity-type"
POOL = "spotguard-test/pool"
FALLBACK_AFTER = 2.0
MAX = 4


def _job(pool: str) -> dict:
    either = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": CAPACITY, "operator": "In", "values": ["spot", "on-demand"]}]}]}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2",
                                         names.ANN_IN_PLACE: "true", names.ANN_FALLBACK: "on-demand",
                                         names.ANN_FALLBACK_AFTER: f"{FALLBACK_AFTER:g}s",
                                         names.ANN_RETURN_AFTER: "10m"}},
            "spec": {"parallelism": MAX, "completions": MAX, "completionMode": "Indexed", "backoffLimit": 6,
                     "podFailurePolicy": {"rules": [{"action": "Ignore", "onExitCodes": {
                         "containerName": "train", "operator": "In", "values": [names.EXIT_PREEMPTED]}}]},
                     "template": {"spec": {
                         "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                         "nodeSelector": {POOL: pool}, "affinity": either, "schedulingGates": [{"name": GATE}],
                         "containers": [{"name": "train", "image": "train:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


async def test_backfill_places_spot_at_once_and_on_demand_after_fallback_after(control_plane, k8s_namespace):
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    ns = pool = k8s_namespace
    spot = {add_ready_node(control_plane, f"{pool}-spot-{i}", {CAPACITY: "spot", POOL: pool}) for i in (1, 2)}
    on_demand = {add_ready_node(control_plane, f"{pool}-od-{i}", {CAPACITY: "on-demand", POOL: pool})
                 for i in (1, 2)}
    batch.create_namespaced_job(ns, _job(pool))

    def pods():
        return core.list_namespaced_pod(ns, label_selector="batch.kubernetes.io/job-name=train").items

    gated = await asyncio.to_thread(wait_until, lambda: len(pods()) == MAX and pods(), 30, "the Job's gated pods")
    assert all(p.spec.scheduling_gates and not p.spec.node_name for p in gated)

    config = ControllerConfig(identity="supervisor-test", namespace=ns, resync=5.0,
                              settings=Settings(checkpoint_timeout=30.0))
    controller = Controller(Kube(control_plane.client_as("spotguard-supervisor")), config)
    started = time.monotonic()
    await controller.start()
    try:
        def bound_on(nodes: set[str], count: int):
            mine = [p for p in pods() if p.spec.node_name in nodes]
            return mine if len(mine) == count else None

        on_spot = await asyncio.to_thread(wait_until, lambda: bound_on(spot, 2), 30, "2 pods bound on spot")
        for i, pod in enumerate(on_spot):  # the kubelet's part: they run
            await asyncio.to_thread(set_pod_running, control_plane, ns, pod.metadata.name, f"10.244.1.{i + 1}")
        on_od = await asyncio.to_thread(wait_until, lambda: bound_on(on_demand, 2), FALLBACK_AFTER + 30,
                                        "2 pods bound on on-demand")
        at_max = time.monotonic() - started
        print(f"backfill: supervisor start -> {MAX} replicas bound (2 spot, 2 on-demand) {at_max:.2f}s "
              f"(fallback-after {FALLBACK_AFTER:g}s)")
        assert at_max <= FALLBACK_AFTER + 10, at_max
        assert {p.spec.node_selector[CAPACITY] for p in on_spot} == {"spot"}
        assert {p.spec.node_selector[CAPACITY] for p in on_od} == {"on-demand"}
        assert not [p for p in pods() if p.spec.scheduling_gates]

        def record():
            job = batch.read_namespaced_job("train", ns)
            rec = parse_record((job.metadata.annotations or {}).get(names.ANN_STATUS))
            return rec if rec.split == {"spot": 2, "on-demand": 2} else None

        rec = await asyncio.to_thread(wait_until, record, 30, "the split in the record")
        assert rec.below_max_since is not None and rec.backfill_at is not None
        waited = (rec.backfill_at - rec.below_max_since).total_seconds()
        assert waited >= FALLBACK_AFTER, waited  # on-demand never before fallback-after
        assert "fallback-after" in rec.backfill
        job = batch.read_namespaced_job("train", ns)
        assert (job.spec.parallelism, job.spec.suspend) == (MAX, False)
    finally:
        await controller.stop()
