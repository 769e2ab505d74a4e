"""The real control plane fixture, and the RBAC of daemonset/base as the API server enforces it:
each component's ServiceAccount can do what its code does and is Forbidden the rest."""
from __future__ import annotations

import kubernetes
import pytest

from tests.k8s_world import add_ready_node, wait_until

pytestmark = pytest.mark.k8s


def _allowed(plane, service_account: str, verb: str, resource: str, group: str = "", namespace: str = "default",
             subresource: str = "", name: str = "") -> bool:
    """SelfSubjectAccessReview as the ServiceAccount: what the API server itself would decide."""
    auth = kubernetes.client.AuthorizationV1Api(plane.client_as(service_account))
    attrs = {"verb": verb, "resource": resource, "group": group, "namespace": namespace}
    if subresource:
        attrs["subresource"] = subresource
    if name:
        attrs["name"] = name
    review = auth.create_self_subject_access_review({"spec": {"resourceAttributes": attrs}})
    return bool(review.status.allowed)


@pytest.mark.parametrize("service_account,verb,resource,group,subresource,expected", [
    ("spotguard-agent", "patch", "nodes", "", "", True),
    ("spotguard-agent", "create", "tokenreviews", "authentication.k8s.io", "", True),
    ("spotguard-agent", "get", "secrets", "", "", False),
    ("spotguard-agent", "delete", "pods", "", "", False),
    ("spotguard-supervisor", "patch", "jobs", "batch", "", True),
    ("spotguard-supervisor", "patch", "jobs", "batch", "status", True),
    ("spotguard-supervisor", "list", "secrets", "", "", False),
    ("spotguard-supervisor", "delete", "pods", "", "", False),
    ("spotguard-injector", "get", "secrets", "", "", False),
    ("spotguard-injector", "patch", "nodes", "", "", False),
])
def test_service_account_rbac_is_enforced(control_plane, service_account, verb, resource, group, subresource,
                                          expected):
    assert _allowed(control_plane, service_account, verb, resource, group, subresource=subresource) is expected


def test_job_controller_and_scheduler_place_an_indexed_jobs_pods(control_plane, k8s_namespace):
    """The fixture runs the real Job controller and scheduler: an Indexed Job's pods are created
    and bound to a Ready node, and `suspend: true` removes them (grace period 0, no kubelet)."""
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    node = add_ready_node(control_plane, f"{k8s_namespace}-n1")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
           "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed",
                    "template": {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                                          "nodeSelector": {"kubernetes.io/hostname": node},
                                          "containers": [{"name": "train", "image": "train:1"}]}}}}
    batch.create_namespaced_job(k8s_namespace, job)

    def bound():
        pods = core.list_namespaced_pod(k8s_namespace, label_selector="job-name=train").items
        return len(pods) == 2 and all(p.spec.node_name == node for p in pods)

    wait_until(bound, 60, "two pods bound to the node")
    batch.patch_namespaced_job("train", k8s_namespace, {"spec": {"suspend": True}})
    wait_until(lambda: not core.list_namespaced_pod(k8s_namespace, label_selector="job-name=train").items, 60,
               "pods removed after suspend")
