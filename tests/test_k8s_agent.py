"""The node agent against a real kube-apiserver, as its own ServiceAccount (spotguard-agent, RBAC
of daemonset/base): node marks and Events (tests/test_node_marker.py does the same on kmock,
plus the faults a real server will not make), and the TokenReview of `POST /v1/reports` with
pod-bound projected tokens."""
from __future__ import annotations

import asyncio
import logging

import kubernetes
import pytest

from spotguard.agent.auth import AuthError, TokenReviewAuth
from spotguard.agent.node_marker import PATCH_TYPE, NodeMarker
from spotguard.backoff import Backoff
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice
from tests.k8s_world import add_ready_node, refusals, wait_service_account, wait_until
from tests.test_node_marker import make_notice

pytestmark = pytest.mark.k8s
AGENT = "spotguard-agent"


def _pod(name: str, node: str | None, inject: bool = True) -> dict:
    labels = {"spotguard.io/inject": "true"} if inject else {"app": "web"}
    spec = {"terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels}, "spec": spec}


def _events_about(core, namespace: str, kind: str, name: str) -> list:
    items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e for e in items if e.involved_object.kind == kind and e.reason == names.EVENT_NOTICE]


async def test_agent_marks_node_posts_events_cordons_and_unmarks(control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    node = await asyncio.to_thread(add_ready_node, control_plane, f"{k8s_namespace}-a")
    wait_service_account(control_plane, k8s_namespace)
    for pod in (_pod("train-0", node), _pod("web-0", node, inject=False)):
        await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, pod)
    reclaim = make_notice(Kind.RECLAIM, 120, "r", node=node)
    marker = NodeMarker(control_plane.client_as(AGENT), node, cordon=True, backoff=Backoff(base=0.1, cap=1.0))
    await marker.start()
    try:
        marker.notify([reclaim])
        await asyncio.to_thread(wait_until, lambda: marker.in_sync, 20, "node marked")
        marked = await asyncio.to_thread(core.read_node, node)
        assert Notice.from_json(marked.metadata.annotations[names.ANN_NOTICE]) == reclaim
        ours = [t for t in marked.spec.taints or [] if t.key == names.TAINT_RECLAIM]
        assert [(t.value, t.effect) for t in ours] == [("reclaim", "NoSchedule")]
        assert marked.spec.unschedulable is True and marked.metadata.annotations[names.ANN_CORDONED] == "true"
        assert len(_events_about(core, "default", "Node", node)) == 1
        assert len(_events_about(core, k8s_namespace, "Pod", "train-0")) == 1
        assert not _events_about(core, k8s_namespace, "Pod", "web-0")

        marker.notify([])  # withdrawn
        await asyncio.to_thread(wait_until, lambda: marker.in_sync, 20, "node unmarked")
    finally:
        await marker.stop()
    clean = await asyncio.to_thread(core.read_node, node)
    assert names.ANN_NOTICE not in (clean.metadata.annotations or {})
    assert not [t for t in clean.spec.taints or [] if t.key == names.TAINT_RECLAIM] and not clean.spec.unschedulable
    assert marker.stats["errors"] == 0 and marker.stats["marked"] == 1 and marker.stats["unmarked"] == 1
    assert not refusals(caplog)
    await asyncio.to_thread(core.delete_node, node)


def test_a_stale_resource_version_in_the_agents_patch_is_a_409(control_plane, k8s_namespace):
    """The marker's conflict handling rests on the API server answering 409 to a strategic-merge
    patch that carries an outdated resourceVersion (kmock only emulates it)."""
    core = kubernetes.client.CoreV1Api(control_plane.client_as(AGENT))
    node = add_ready_node(control_plane, f"{k8s_namespace}-c")
    stale = core.read_node(node).metadata.resource_version
    core.patch_node(node, {"metadata": {"labels": {"example.com/x": "1"}}}, _content_type=PATCH_TYPE)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        core.patch_node(node, {"metadata": {"resourceVersion": stale, "annotations": {names.ANN_NOTICE: "{}"}}},
                        _content_type=PATCH_TYPE)
    assert refused.value.status == 409
    kubernetes.client.CoreV1Api(control_plane.api_client()).delete_node(node)


async def test_report_token_review_with_pod_bound_tokens(control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    core = kubernetes.client.CoreV1Api(control_plane.api_client())
    wait_service_account(control_plane, k8s_namespace)
    pod = (await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, _pod("train-0", None))).to_dict()
    bound = control_plane.service_account_token("default", k8s_namespace, audiences=["spotguard"], bound_pod=pod)
    other_audience = control_plane.service_account_token("default", k8s_namespace, audiences=["vault"],
                                                         bound_pod=pod)
    auth = TokenReviewAuth(control_plane.client_as(AGENT), ttl=0.0, negative_ttl=0.0)

    caller = await auth.authenticate(f"Bearer {bound}")
    assert (caller.namespace, caller.pod) == (k8s_namespace, "train-0")
    assert caller.may_report_for(k8s_namespace, "train-0") and not caller.may_report_for(k8s_namespace, "train-1")
    with pytest.raises(AuthError) as wrong_audience:
        await auth.authenticate(f"Bearer {other_audience}")
    assert wrong_audience.value.status == 401

    await asyncio.to_thread(core.delete_namespaced_pod, "train-0", k8s_namespace, grace_period_seconds=0)
    await asyncio.to_thread(wait_until, lambda: not core.list_namespaced_pod(k8s_namespace).items, 20, "pod gone")
    async def refused() -> int:  # a bound token dies with its pod (the server caches a review for ~10 s)
        try:
            await auth.authenticate(f"Bearer {bound}")
        except AuthError as exc:
            return exc.status
        return 0

    deadline = asyncio.get_running_loop().time() + 30
    while (status := await refused()) == 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.5)
    assert status == 401
    assert not refusals(caplog)
