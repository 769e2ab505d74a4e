"""Helpers for tests against the real control plane (tests/control_plane.py): Nodes made Ready
through their status (no kubelet here), pod exit codes written through `pods/status` as a kubelet
would, the Kubeflow PyTorchJob CRD, and a bounded wait. Blocking calls: wrap them in
`asyncio.to_thread` from async tests."""
from __future__ import annotations

import time
from datetime import datetime, UTC
from collections.abc import Callable

import kubernetes


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def add_ready_node(plane, name: str, labels: dict | None = None, gpus: int = 1, cpu: str = "8") -> str:
    """Create Node `name` and set its status as a kubelet would: Ready=True, capacity with GPUs.
    Returns the name. The not-ready taint is removed by the node lifecycle controller."""
    core = kubernetes.client.CoreV1Api(plane.api_client())
    all_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    core.create_node({"metadata": {"name": name, "labels": all_labels}})
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    resources = {"cpu": cpu, "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    status = {"status": {"capacity": resources, "allocatable": resources,
                         "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                         "message": "test", "lastHeartbeatTime": now,
                                         "lastTransitionTime": now}]}}
    core.patch_node_status(name, status)
    wait_until(lambda: not [t for t in (core.read_node(name).spec.taints or [])
                            if t.key == "node.kubernetes.io/not-ready"], 30, f"node {name} schedulable")
    return name


def set_container_exit(plane, namespace: str, pod: str, exit_code: int, container: str | None = None,
                       finished_at: datetime | None = None, restarted: bool = False, message: str = "",
                       uid: str | None = None) -> None:
    """Write a terminated container status with `exit_code` at `finished_at` (default now) and the
    termination `message` through `pods/status`, as a kubelet would; `restarted`: the container
    runs again and the exit is its lastState (restartPolicy OnFailure). With `uid`, a pod of that
    name that is not that one (deleted and made again) raises a 404 ApiException, as a gone pod does."""
    core = kubernetes.client.CoreV1Api(plane.api_client())
    current = core.read_namespaced_pod(pod, namespace)
    if uid is not None and current.metadata.uid != uid:
        raise kubernetes.client.ApiException(status=404, reason=f"pod {pod} was made again (uid {uid} is gone)")
    name = container or current.spec.containers[0].name
    when = (finished_at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    term = {"terminated": {"exitCode": exit_code, "startedAt": when, "finishedAt": when,
                           "reason": "Error" if exit_code else "Completed",
                           **({"message": message} if message else {})}}
    phase = "Running" if restarted else ("Succeeded" if exit_code == 0 else "Failed")
    status = {"name": name, "image": current.spec.containers[0].image, "imageID": "", "ready": restarted,
              "restartCount": 1 if restarted else 0}
    status.update({"state": {"running": {"startedAt": when}}, "lastState": term} if restarted else {"state": term})
    core.patch_namespaced_pod_status(pod, namespace, {"status": {"phase": phase, "containerStatuses": [status]}})


def set_pod_running(plane, namespace: str, pod: str, pod_ip: str | None = None, ready: bool | None = None) -> None:
    """Write `phase: Running` with a running container through `pods/status`, as a kubelet would;
    with `pod_ip` the pod's IP, with `ready` its Ready condition (and the containers' readiness,
    as a readiness probe sets them)."""
    core = kubernetes.client.CoreV1Api(plane.api_client())
    current = core.read_namespaced_pod(pod, namespace)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    statuses = [{"name": c.name, "image": c.image, "imageID": "", "ready": ready is not False, "restartCount": 0,
                 "state": {"running": {"startedAt": now}}} for c in current.spec.containers]
    status: dict = {"phase": "Running", "containerStatuses": statuses}
    if pod_ip is not None:
        status.update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}]
    core.patch_namespaced_pod_status(pod, namespace, {"status": status})


def wait_service_account(plane, namespace: str, name: str = "default", timeout: float = 30) -> None:
    """Wait until the controller-manager created ServiceAccount `namespace/name` (pods need it)."""
    core = kubernetes.client.CoreV1Api(plane.api_client())

    def exists():
        try:
            return core.read_namespaced_service_account(name, namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
    wait_until(exists, timeout, f"serviceaccount {namespace}/{name}")


# kubeflow.org/v1 PyTorchJob, written here: the training-operator's published manifest cannot be
# fetched (no network in CI) and is not copied. What the supervisor relies on is the same as in
# that manifest: namespaced, the `status` subresource (it patches `pytorchjobs/status`, so a
# write of the main resource ignores status), and a structural schema; unknown fields are
# preserved instead of the published one's full pod-template schema (no pruning of what we write).
PYTORCHJOB_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "pytorchjobs.kubeflow.org"},
    "spec": {"group": "kubeflow.org", "scope": "Namespaced",
             "names": {"plural": "pytorchjobs", "singular": "pytorchjob", "kind": "PyTorchJob",
                       "listKind": "PyTorchJobList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}


def install_pytorchjob_crd(plane) -> None:
    """Installs PYTORCHJOB_CRD (idempotent: server-side apply) and returns once PyTorchJobs are
    served (the CRD is Established and a list answers)."""
    plane.apply([PYTORCHJOB_CRD])
    extensions = kubernetes.client.ApiextensionsV1Api(plane.api_client())
    custom = kubernetes.client.CustomObjectsApi(plane.api_client())

    def established():
        crd = extensions.read_custom_resource_definition(PYTORCHJOB_CRD["metadata"]["name"])
        return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))

    def served():
        try:
            return custom.list_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs") is not None
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
    wait_until(established, 30, "the PyTorchJob CRD established")
    wait_until(served, 30, "PyTorchJobs served")


def refusals(caplog) -> list[str]:
    """Log lines that show the API server refusing a component: 403 / Forbidden (RBAC)."""
    import re

    pattern = re.compile(r"\b403\b|forbidden", re.IGNORECASE)
    return [r.getMessage() for r in caplog.records if pattern.search(r.getMessage() + (r.exc_text or ""))]
