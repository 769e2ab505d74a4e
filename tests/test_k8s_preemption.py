"""Pods that Kubernetes takes away (`DisruptionTarget`, supervisor/disruption.py) on a real
kube-apiserver, with the real kube-scheduler doing the preemption (no kubelet: the test writes
what a kubelet would: phases, IPs, readiness, exit codes, and the end of a victim's grace period).

ElasticDL's experiment: a higher-priority serving Deployment scales up and the scheduler preempts
training pods of an in-place elastic Indexed Job (4 of 4 GPUs taken); the job shrinks in place to
the survivors (no suspend, no scale, one `SpotguardLeavingInPlace` decision); the Deployment
scales down and the job's replacements join in place, back at max. The eviction API is the other
path of the same condition."""
from __future__ import annotations

import asyncio
import logging
import time

import kubernetes

from spotguard.wire import names
from tests.k8s_world import refusals, set_container_exit, set_pod_running, wait_until
from tests.test_k8s_supervisor import POOL, World, _controller
from tests.test_k8s_in_place import PORT, _in_place_job, _index, _membership, _running_in_place_job

import pytest

pytestmark = pytest.mark.k8s
SERVING = "serving"


def _preemptible_job(ns: str) -> dict:
    """The in-place Job with a grace period (victims stay Terminating while they drain, as with a
    kubelet) and the podFailurePolicy rule that keeps a disruption from counting as a failure."""
    job = _in_place_job(ns)
    job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    job["spec"]["podFailurePolicy"]["rules"].append(
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]})
    return job


def _serving(ns: str, replicas: int, priority_class: str) -> dict:
    template = {"metadata": {"labels": {"app": SERVING}},
                "spec": {"priorityClassName": priority_class, "terminationGracePeriodSeconds": 0,
                         "nodeSelector": {POOL: ns},
                         "containers": [{"name": "serve", "image": "serve:1",
                                         "resources": {"requests": {"nvidia.com/gpu": "1"},
                                                       "limits": {"nvidia.com/gpu": "1"}}}]}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": SERVING},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": SERVING}}, "template": template}}


class Kubelet:
    """What a kubelet would do for the test's pods, done through the API (blocking)."""

    def __init__(self, plane, ns: str):
        self.plane, self.ns = plane, ns
        self.core = kubernetes.client.CoreV1Api(plane.api_client())

    def all_job_pods(self) -> list:
        return self.core.list_namespaced_pod(self.ns, label_selector="job-name=train").items

    def victims(self) -> list:
        return [p for p in self.all_job_pods() if p.metadata.deletion_timestamp and any(
            c.type == "DisruptionTarget" and c.status == "True" for c in p.status.conditions or [])]

    def drain_and_end(self, pod) -> None:
        """The Guard's drain (exit 83), then the end of the grace period (the pod object goes)."""
        set_container_exit(self.plane, self.ns, pod.metadata.name, names.EXIT_PREEMPTED)
        self.core.delete_namespaced_pod(pod.metadata.name, self.ns, grace_period_seconds=0)

    def run_serving(self) -> list:
        pods = [p for p in self.core.list_namespaced_pod(self.ns, label_selector=f"app={SERVING}").items
                if p.spec.node_name and p.status.phase != "Running"]
        for pod in pods:
            set_pod_running(self.plane, self.ns, pod.metadata.name)
        return pods


@pytest.fixture
def priority_class(control_plane, k8s_namespace):
    scheduling = kubernetes.client.SchedulingV1Api(control_plane.api_client())
    name = f"{k8s_namespace}-high"
    scheduling.create_priority_class({"metadata": {"name": name}, "value": 100000, "preemptionPolicy":
                                      "PreemptLowerPriority", "description": "serving, preempts training"})
    try:
        yield name
    finally:
        scheduling.delete_priority_class(name)


def _agreed(world: World, pods: list) -> dict | None:
    """The membership every one of `pods` was told, once they all were told the same one."""
    values = [_membership(world, p.metadata.name) for p in pods]
    return values[0] if all(v == values[0] and v is not None for v in values) else None


async def _running_job(plane, ns: str) -> tuple[World, dict]:
    return await _running_in_place_job(plane, ns, _preemptible_job(ns))


async def test_preempted_by_a_serving_deployment_the_job_shrinks_in_place_and_grows_back(
        control_plane, k8s_namespace, priority_class, caplog):
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world, by_index = await _running_job(plane, ns)
    kubelet = Kubelet(plane, ns)
    apps = kubernetes.client.AppsV1Api(plane.api_client())
    controller = _controller(plane, ns)
    await controller.start()
    try:
        names_by_index = {i: p.metadata.name for i, p in by_index.items()}
        await asyncio.to_thread(apps.create_namespaced_deployment, ns, _serving(ns, 2, priority_class))
        victims = await asyncio.to_thread(wait_until, lambda: (v := kubelet.victims()) and len(v) == 2 and v, 60,
                                          "the scheduler's 2 preemption victims (DisruptionTarget, Terminating)")
        assert {c.reason for v in victims for c in v.status.conditions if c.type == "DisruptionTarget"} == \
            {"PreemptionByScheduler"}
        victim_names = {v.metadata.name for v in victims}
        survivors = [by_index[i] for i in sorted(by_index) if names_by_index[i] not in victim_names]
        survivor_hosts = [p.spec.node_name for p in survivors]

        def survivors_told():
            return _agreed(world, survivors)
        # The scheduler may preempt both at once or one per scheduling cycle: one decision each.
        shrunk = await asyncio.to_thread(
            wait_until, lambda: (v := survivors_told()) and v["hosts"] == survivor_hosts and v, 30,
            "the survivors' membership")
        assert shrunk["world_size"] == 2
        record = await asyncio.to_thread(world.record)
        assert record["phase"] == "Running" and record["reclaims_survived"] in (1, 2)
        assert sorted(h.split("/")[1] for h in record["handled"]) == sorted(victim_names)
        events = await asyncio.to_thread(wait_until, lambda: world.events(names.EVENT_LEAVING_IN_PLACE), 30,
                                         "the Event")
        assert "PreemptionByScheduler/" in events[0].message
        job = await asyncio.to_thread(world.job)
        assert job["spec"]["parallelism"] == 4 and not job["spec"]["suspend"]  # in place: no scale, no suspend

        # The victims' ranks drain and their pods end; the scheduler binds the serving pods there.
        for victim in victims:
            await asyncio.to_thread(kubelet.drain_and_end, victim)
        await asyncio.to_thread(wait_until, lambda: len(kubelet.run_serving()) == 2 or None, 60,
                                "the serving pods bound to the freed nodes")
        # The Job controller replaces the victims (podFailurePolicy Ignore); no room: Pending.
        survivor_names = {p.metadata.name for p in survivors}

        def replacements():
            pods = [p for p in world.pods() if p.metadata.name not in survivor_names]
            return pods if len(pods) == 2 else None
        pending = await asyncio.to_thread(wait_until, replacements, 90, "2 replacement pods")
        assert not any(p.spec.node_name for p in pending)

        # The serving load goes; capacity is free from here.
        await asyncio.to_thread(apps.patch_namespaced_deployment_scale, SERVING, ns, {"spec": {"replicas": 0}})
        freed = time.monotonic()
        seen_ready: set[str] = set()

        def back_at_max():
            for pod in world.pods():
                if pod.spec.node_name and pod.metadata.name not in survivor_names | seen_ready:
                    set_pod_running(plane, ns, pod.metadata.name, f"10.244.1.{_index(pod) + 1}", True)
                    seen_ready.add(pod.metadata.name)
            value = survivors_told()
            return value if value and len(value["hosts"]) == 4 else None
        grown = await asyncio.to_thread(wait_until, back_at_max, 60, "the membership back at 4")
        seconds = time.monotonic() - freed
        print(f"preemption: capacity free -> membership back at max {seconds:.2f}s")
        assert grown["hosts"][:2] == survivor_hosts  # the survivors keep their ranks; joiners appended
        assert grown["store"] == shrunk["store"] == f"10.244.0.{_index(survivors[0]) + 1}:{PORT}"
        assert grown["world_size"] == 4 and grown["generation"] > shrunk["generation"]
        for reason in (names.EVENT_SUSPENDED, names.EVENT_SCALED):
            assert not await asyncio.to_thread(world.events, reason), reason
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)


async def test_an_evicted_pod_is_a_notice_for_that_pod_only(control_plane, k8s_namespace, caplog):
    """The eviction API (as `kubectl drain` calls it) sets the same condition: the job shrinks in
    place by that one pod, and its node is neither marked nor counted as lost."""
    caplog.set_level(logging.INFO)
    plane, ns = control_plane, k8s_namespace
    world, by_index = await _running_job(plane, ns)
    controller = _controller(plane, ns)
    await controller.start()
    try:
        evicted = by_index[2]
        await asyncio.to_thread(world.core.create_namespaced_pod_eviction, evicted.metadata.name, ns,
                                {"metadata": {"name": evicted.metadata.name, "namespace": ns}})
        others = [by_index[i] for i in (0, 1, 3)]

        value = await asyncio.to_thread(wait_until, lambda: _agreed(world, others), 30,
                                        "the membership without the evicted pod")
        assert value["hosts"] == [p.spec.node_name for p in others] and value["store"] == f"10.244.0.1:{PORT}"
        record = await asyncio.to_thread(world.record)
        assert record["handled"][-1].startswith(f"EvictionByEvictionAPI/{evicted.metadata.name}/")
        node = await asyncio.to_thread(world.core.read_node, evicted.spec.node_name)
        assert names.ANN_NOTICE not in (node.metadata.annotations or {})
        assert not [t for t in node.spec.taints or [] if t.key == names.TAINT_RECLAIM]
    finally:
        await controller.stop()
        await asyncio.to_thread(world.cleanup)
    assert not refusals(caplog)
