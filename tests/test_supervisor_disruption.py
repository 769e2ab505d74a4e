"""A replica pod that Kubernetes takes away (`DisruptionTarget=True`) is a notice for that pod,
through every policy (kmock over real HTTP; the real scheduler's preemption is
tests/test_k8s_preemption.py): elastic scales to the others, fixed waits for the checkpoint, then
suspends, and the pod's node stays unmarked."""
from __future__ import annotations

import asyncio
import json
from spotguard.kube.api import NODES, PODS
from spotguard.wire import names
from tests.supervisor_cluster import NS, eventually, running_cluster

NODE_NAMES = ["n0", "n1", "n2", "n3"]


async def disrupt(cluster, pod: str, reason: str) -> None:
    """What the scheduler / eviction API writes first: the condition (kmock drops a pod whose
    deletionTimestamp is set, so the graceful deletion that follows is left out here; the grace
    period as the deadline is tests/test_disruption.py)."""
    await cluster.call(cluster.kube.patch, PODS, NS, pod, {
        "status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": reason}]}})


async def decided(cluster, job: str, event: str) -> dict:
    async def check():
        obj = await cluster.job(job)
        record = json.loads(obj["metadata"]["annotations"].get(names.ANN_STATUS, "{}"))
        return (obj, record) if record.get("event") == event else None
    return await eventually(check, what=f"decision {event}")


async def test_elastic_scales_to_the_others_and_leaves_the_node_unmarked():
    async with running_cluster() as cluster:
        for node in NODE_NAMES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODE_NAMES, {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2"})
        controller = cluster.controller()
        await controller.start()
        try:
            await disrupt(cluster, "j1-1", "EvictionByEvictionAPI")
            job, record = await decided(cluster, "j1", names.EVENT_SCALED)
            assert job["spec"]["parallelism"] == 3 and record["reclaims_survived"] == 1
            assert record["handled"] == ["EvictionByEvictionAPI/j1-1/"]  # kmock gives pods no uid
            assert record["members"] == ["n0", "n2", "n3"]
            node = await cluster.call(cluster.kube.get, NODES, None, "n1")
            assert names.ANN_NOTICE not in (node["metadata"].get("annotations") or {})
            assert controller.cache.free_slots(("Job", NS, "j1"), job["spec"]["template"]["spec"], False) == 0
        finally:
            await controller.stop()


async def test_fixed_waits_for_the_checkpoint_then_suspends():
    async with running_cluster() as cluster:
        for node in NODE_NAMES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODE_NAMES, {names.ANN_POLICY: "fixed"})
        controller = cluster.controller()
        await controller.start()
        try:
            await disrupt(cluster, "j1-2", "PreemptionByScheduler")
            job, record = await decided(cluster, "j1", names.EVENT_CHECKPOINTING)
            assert job["spec"]["suspend"] is False and "PreemptionByScheduler/j1-2/" in record["message"]
            # The Guard drains on the kubelet's SIGTERM. A kubelet writes finishedAt in whole seconds and
            # a drain must end at/after the decision to count: let the decision's second pass.
            await asyncio.sleep(1.0)
            await cluster.exit_pod("j1", 2, names.EXIT_PREEMPTED)
            # Suspended after the checkpoint; kmock runs no Job controller, so the drained pod's
            # slot is free at once and the job may already be resumed: read its history.
            suspended = await eventually(lambda: cluster.events("j1", names.EVENT_SUSPENDED), what="suspension")
            assert "drained after its checkpoint" in suspended[0]["message"]
            assert {"parallelism": 4, "suspend": True} in cluster.spec_writes("j1")
        finally:
            await controller.stop()
