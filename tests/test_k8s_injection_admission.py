"""Injection never makes an admissible pod inadmissible, checked by the real API server: pods
that a namespace enforcing Pod Security `restricted`, a ResourceQuota on limits.cpu/memory, or
both admit are still admitted once the injector's JSON patch is applied to them (also a pod of an
in-place job: its ready-file volume and readiness probe)."""
from __future__ import annotations

import copy

import jsonpatch
import kubernetes
import pytest

from spotguard.injector.patch import SIDECAR_NAME, InjectorConfig, build_patch
from tests.k8s_world import wait_until

pytestmark = pytest.mark.k8s

CFG = InjectorConfig(image="spotguard:test")
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}


def _pod(name: str, pod_ctx: dict | None, container_ctx: dict, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"spotguard.io/inject": "true"}},
            "spec": {**({"securityContext": pod_ctx} if pod_ctx is not None else {}),
                     "containers": [{"name": "trainer", "image": "train:1", "resources": RESOURCES,
                                     "securityContext": container_ctx}], **spec}}


# Each admitted by all three namespaces as written.
PODS = {
    "pod-level-user": _pod("pod-level-user", {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                              "seccompProfile": {"type": "RuntimeDefault"}}, RESTRICTED_CONTAINER),
    "container-level-only": _pod("container-level-only", None, {
        **RESTRICTED_CONTAINER, "runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 1002,
        "seccompProfile": {"type": "RuntimeDefault"}}),
    "image-user": _pod("image-user", {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                       RESTRICTED_CONTAINER),
    "existing-init-and-volumes": _pod(
        "existing-init-and-volumes", {"runAsNonRoot": True, "runAsUser": 2000, "fsGroup": 2000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}, RESTRICTED_CONTAINER,
        initContainers=[{"name": "fetch", "image": "fetch:1", "resources": RESOURCES,
                         "securityContext": RESTRICTED_CONTAINER}],
        volumes=[{"name": "data", "emptyDir": {}}]),
    "in-place": {**_pod("in-place", {"runAsNonRoot": True, "runAsUser": 1000,
                                     "seccompProfile": {"type": "RuntimeDefault"}}, RESTRICTED_CONTAINER),
                 "metadata": {"name": "in-place", "labels": {"spotguard.io/inject": "true"},
                              "annotations": {"spotguard.io/in-place": "true"}}},
}
EXPECTED_USER = {"pod-level-user": (1000, 1000), "container-level-only": (1001, 1002), "image-user": (65532, None),
                 "existing-init-and-volumes": (2000, None), "in-place": (1000, None)}


def _core(plane):
    return kubernetes.client.CoreV1Api(plane.api_client())


def _admitted(core, namespace: str, pod: dict) -> str | None:
    """None when the server admits `pod` (server-side dry run), else its refusal."""
    try:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    except kubernetes.client.ApiException as exc:
        return f"{exc.status}: {exc.body}"
    return None


def _restrict(plane, namespace: str) -> None:
    core = _core(plane)
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                                             "pod-security.kubernetes.io/enforce-version": "latest"}}})
    probe = {
        "metadata": {"name": "probe"},
        "spec": {"containers": [{"name": "c", "image": "x", "resources": RESOURCES}]},
    }
    wait_until(lambda: _admitted(core, namespace, probe), 30, "Pod Security restricted enforced")


def _quota(plane, namespace: str) -> None:
    core = _core(plane)
    core.create_namespaced_resource_quota(namespace, {"metadata": {"name": "limits"}, "spec": {"hard": {
        "limits.cpu": "8", "limits.memory": "16Gi", "requests.cpu": "8", "requests.memory": "16Gi"}}})
    wait_until(lambda: (core.read_namespaced_resource_quota("limits", namespace).status.hard or {}), 60,
               "quota status computed by the controller")
    probe = {"metadata": {"name": "probe"}, "spec": {"securityContext": PODS["image-user"]["spec"]["securityContext"],
                                                     "containers": [{"name": "c", "image": "x",
                                                                     "securityContext": RESTRICTED_CONTAINER}]}}
    wait_until(lambda: _admitted(core, namespace, probe), 30, "quota enforced")


NAMESPACE_KINDS = {"restricted": (_restrict,), "quota": (_quota,), "restricted+quota": (_restrict, _quota)}


@pytest.mark.parametrize("kind", list(NAMESPACE_KINDS))
def test_injected_pods_stay_admissible(control_plane, k8s_namespace, kind):
    for setup in NAMESPACE_KINDS[kind]:
        setup(control_plane, k8s_namespace)
    core = _core(control_plane)
    refused, created = {}, {}
    for name, pod in PODS.items():
        assert _admitted(core, k8s_namespace, pod) is None, f"{name} must be admissible before injection"
        ops = build_patch(copy.deepcopy(pod), CFG)
        assert ops, name
        injected = jsonpatch.apply_patch(copy.deepcopy(pod), ops)
        try:
            created[name] = core.create_namespaced_pod(k8s_namespace, injected)
        except kubernetes.client.ApiException as exc:
            refused[name] = f"{exc.status}: {exc.body}"
    assert not refused, f"injection made admissible pods inadmissible in a {kind} namespace: {refused}"
    for name, pod in created.items():
        (sidecar,) = [c for c in pod.spec.init_containers if c.name == SIDECAR_NAME]
        ctx = sidecar.security_context
        user, group = EXPECTED_USER[name]
        assert (ctx.run_as_non_root, ctx.run_as_user, ctx.run_as_group) == (True, user, group), (name, ctx)
        assert set(sidecar.resources.limits) >= {"cpu", "memory"}, sidecar.resources
        assert set(sidecar.resources.requests) >= {"cpu", "memory"}, sidecar.resources
    probe = created["in-place"].spec.containers[0].readiness_probe
    assert probe is not None and probe._exec.command[:2] == ["test", "-f"]
