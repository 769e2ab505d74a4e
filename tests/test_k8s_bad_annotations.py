"""Conflicting annotations on the real kube-apiserver (tests/control_plane.py): on-demand-max above
max, in-place on the fixed policy, and the fallback on a job whose template names no
capacity-type label each get ONE Warning Event naming the annotation, and the supervisor leaves
the job as it is, even with a reclaim notice on the node its pod runs on. The jobs exist before
the supervisor starts (its first list returns them without `kind`): each Event still names its
Job (involvedObject kind and apiVersion), so `kubectl describe job` and `spotguard status NAME`
show it, and the table names the reason."""
from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import kubernetes
import pytest

from spotguard.kube.api import Kube
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.policy import Settings
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice
from tests.k8s_world import add_ready_node, wait_until
from tests.test_k8s_status import status

pytestmark = pytest.mark.k8s

CAPACITY = "karpenter.sh/capacity-type"
POOL = "spotguard-test/pool"
BAD = {  # job name -> (its annotations, the annotation the Event must name)
    "od-max-above-max": ({names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true", names.ANN_FALLBACK: "on-demand",
                          names.ANN_ON_DEMAND_MAX: "3"}, names.ANN_ON_DEMAND_MAX),
    "in-place-fixed": ({names.ANN_POLICY: "fixed", names.ANN_IN_PLACE: "true"}, names.ANN_IN_PLACE),
    "fallback-no-selector": ({names.ANN_POLICY: "elastic", names.ANN_FALLBACK: "on-demand"}, names.ANN_FALLBACK),
}


def _job(name: str, annotations: dict, pool: str) -> dict:
    selector = {POOL: pool} if name == "fallback-no-selector" else {CAPACITY: "spot", POOL: pool}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {names.LABEL_MANAGED: "true"}, "annotations": annotations},
            "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed",
                     "template": {"spec": {
                         "restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 0, "nodeSelector": selector,
                         "containers": [{"name": "train", "image": "train:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


async def test_conflicting_annotations_get_one_warning_and_the_job_is_left_alone(control_plane, k8s_namespace):
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    pool = k8s_namespace
    node = add_ready_node(control_plane, f"{pool}-spot", {CAPACITY: "spot", POOL: pool}, gpus=8)
    for name, (given, _) in BAD.items():
        batch.create_namespaced_job(k8s_namespace, _job(name, given, pool))

    def all_bound():
        pods = core.list_namespaced_pod(k8s_namespace).items
        return len(pods) == 2 * len(BAD) and all(p.spec.node_name == node for p in pods)

    await asyncio.to_thread(wait_until, all_bound, 60, "every job's pods bound to the spot node")
    before = {name: batch.read_namespaced_job(name, k8s_namespace) for name in BAD}
    notice = Notice(id=f"aws.spot:{node}", kind=Kind.RECLAIM, source="aws.spot", node=node,
                    detected_at=datetime.now(UTC), deadline=datetime.now(UTC) + timedelta(minutes=2))
    core.patch_node(node, {"metadata": {"annotations": {names.ANN_NOTICE: notice.to_json()}}})

    config = ControllerConfig(identity="supervisor-test", namespace=k8s_namespace, resync=0.5,
                              settings=Settings(checkpoint_timeout=30.0))
    controller = Controller(Kube(control_plane.client_as("spotguard-supervisor")), config)
    await controller.start()
    try:
        def warnings() -> dict[str, list]:
            out: dict[str, list] = {name: [] for name in BAD}
            for e in core.list_namespaced_event(k8s_namespace).items:
                if e.reason == names.EVENT_INVALID_POLICY and e.involved_object.name in out:
                    out[e.involved_object.name].append(e)
            return out

        await asyncio.to_thread(wait_until, lambda: all(warnings().values()), 30, "a Warning Event on every job")
        for name in BAD:  # passes again (as resyncs and later changes make them): nothing more happens
            for _ in range(3):
                assert await controller.reconcile(("Job", k8s_namespace, name)) is None
        for name, events in warnings().items():
            annotation = BAD[name][1]
            assert len(events) == 1, [e.message for e in events]
            assert events[0].type == "Warning" and annotation in events[0].message, events[0].message
            involved = events[0].involved_object
            assert (involved.kind, involved.api_version) == ("Job", "batch/v1"), involved
            # what `kubectl describe job` asks for: the Events whose involvedObject is this Job
            described = core.list_namespaced_event(
                k8s_namespace, field_selector=f"involvedObject.kind=Job,involvedObject.name={name}").items
            assert [e.reason for e in described if e.reason.startswith("Spotguard")] == [names.EVENT_INVALID_POLICY]
            job = batch.read_namespaced_job(name, k8s_namespace)
            assert job.metadata.annotations == before[name].metadata.annotations, name
            assert (job.spec.parallelism, job.spec.suspend) == (2, before[name].spec.suspend), name
            assert job.spec.template.spec.node_selector == before[name].spec.template.spec.node_selector
        kubeconfig = str(control_plane.kubeconfig())
        for name, (_, annotation) in BAD.items():
            one = await asyncio.to_thread(status, name, "-n", k8s_namespace, "--kubeconfig", kubeconfig)
            assert one.returncode == 0, one.stderr
            events = one.stdout.split("Events:\n")[1]
            assert "Warning" in events and names.EVENT_INVALID_POLICY in events and annotation in events, one.stdout
    finally:
        await controller.stop()

