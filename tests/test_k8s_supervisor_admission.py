"""How far the supervisor's and certgen's ServiceAccounts reach, as the real API server decides
with the manifests of daemonset/base: the supervisor's `patch` is fenced by the admission
policies in supervisor/admission-policy.yaml (only the fields its code writes), and certgen can
fill the pre-created TLS Secret but create no Secret (so no service-account token either)."""
from __future__ import annotations

import base64

import kubernetes
import pytest

from spotguard.wire import names
from tests.control_plane import BASE_MANIFESTS, SPOTGUARD_NAMESPACE, load_manifests
from tests.k8s_world import install_pytorchjob_crd, wait_until

pytestmark = pytest.mark.k8s

POLICIES = BASE_MANIFESTS / "supervisor" / "admission-policy.yaml"


def _status(call) -> int:
    """The HTTP status of a write: 200 when accepted."""
    try:
        call()
    except kubernetes.client.ApiException as exc:
        return exc.status
    return 200


@pytest.fixture(scope="module")
def policies(control_plane):
    """The base's admission policies (applied by the session fixture), checked to type-check."""
    admission = kubernetes.client.AdmissionregistrationV1Api(control_plane.api_client())
    for doc in load_manifests(POLICIES):
        if doc["kind"] == "ValidatingAdmissionPolicy":
            status = admission.read_validating_admission_policy(doc["metadata"]["name"]).status
            assert not (status.type_checking and status.type_checking.expression_warnings), status
    return control_plane


def _pod(namespace: str) -> dict:
    return {"metadata": {"name": "trainer-0", "namespace": namespace, "labels": {"app": "train"},
                         "annotations": {"owner": "team-a"}},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "t", "image": "train:1"}]}}


def test_supervisor_may_write_only_the_membership_annotation_of_a_pod(policies, k8s_namespace):
    plane = policies
    kubernetes.client.CoreV1Api(plane.api_client()).create_namespaced_pod(k8s_namespace, _pod(k8s_namespace))
    sup = kubernetes.client.CoreV1Api(plane.client_as("spotguard-supervisor"))

    def patch(body, dry_run=None):
        return _status(lambda: sup.patch_namespaced_pod("trainer-0", k8s_namespace, body, dry_run=dry_run))

    image = {"spec": {"containers": [{"name": "t", "image": "evil:1"}]}}
    wait_until(lambda: patch(image, dry_run="All") == 403, 30, "the pod policy enforced (image change denied)")
    assert patch({"metadata": {"annotations": {"owner": "someone-else"}}}) == 403
    assert patch({"metadata": {"annotations": {"extra": "x"}}}) == 403
    assert patch({"metadata": {"labels": {"app": "other"}}}) == 403
    assert patch({"metadata": {"annotations": {names.ANN_MEMBERSHIP: '{"v":1}'}}}) == 200
    assert patch({"metadata": {"annotations": {names.ANN_MEMBERSHIP: '{"v":1,"generation":2}'}}}) == 200
    pod = kubernetes.client.CoreV1Api(plane.api_client()).read_namespaced_pod("trainer-0", k8s_namespace)
    assert pod.spec.containers[0].image == "train:1" and pod.metadata.annotations["owner"] == "team-a"
    # The policy binds the supervisor only: the admin may still change the image.
    admin = kubernetes.client.CoreV1Api(plane.api_client())
    assert _status(lambda: admin.patch_namespaced_pod("trainer-0", k8s_namespace, image)) == 200


def test_supervisor_may_place_a_gated_pod_and_nothing_more(policies, k8s_namespace):
    """Backfill's placement (supervisor/placement.py): a capacity-type nodeSelector key added and
    the spotguard.io/capacity gate removed; any other spec change, or another gate removed, is
    denied, and an ungated pod's spec stays out of reach."""
    plane = policies
    gated = _pod(k8s_namespace)
    gated["metadata"]["name"] = "trainer-g"
    gated["spec"]["nodeSelector"] = {"pool": "a"}
    gated["spec"]["schedulingGates"] = [{"name": "spotguard.io/capacity"}, {"name": "example.com/quota"}]
    kubernetes.client.CoreV1Api(plane.api_client()).create_namespaced_pod(k8s_namespace, gated)
    sup = kubernetes.client.CoreV1Api(plane.client_as("spotguard-supervisor"))

    def patch(body, dry_run="All"):  # a JSON merge patch, as the supervisor sends (lists replaced, not merged)
        return _status(lambda: sup.patch_namespaced_pod("trainer-g", k8s_namespace, body, dry_run=dry_run,
                                                        _content_type="application/merge-patch+json"))

    keep_quota = [{"name": "example.com/quota"}]
    place = {"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"}, "schedulingGates": keep_quota}}
    toleration = {"spec": {"tolerations": [{"key": "x", "operator": "Exists", "effect": "NoSchedule"}],
                           **place["spec"]}}
    wait_until(lambda: patch(toleration) == 403, 30, "the pod policy enforced (a toleration with the placement denied)")
    image = [{"name": "t", "image": "evil:1", "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
              "terminationMessagePath": "/dev/termination-log"}]
    assert patch({"spec": {**place["spec"], "containers": image}}) in (403, 422)
    assert patch({"spec": {"nodeSelector": {"other.io/key": "x"}, "schedulingGates": keep_quota}}) == 403
    # changing a nodeSelector value: Kubernetes' own validation refuses it (422) before the policy
    assert patch({"spec": {"nodeSelector": {"pool": "b", "karpenter.sh/capacity-type": "spot"},
                           "schedulingGates": keep_quota}}) in (403, 422)
    assert patch({"spec": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"}, "schedulingGates": None}}) == 403
    assert patch(place, dry_run=None) == 200
    pod = kubernetes.client.CoreV1Api(plane.api_client()).read_namespaced_pod("trainer-g", k8s_namespace)
    assert pod.spec.node_selector == {"pool": "a", "karpenter.sh/capacity-type": "on-demand"}
    assert [g.name for g in pod.spec.scheduling_gates] == ["example.com/quota"]
    # placed once: no longer gated by spotguard, so its spec is out of reach again
    assert patch({"spec": {"nodeSelector": {"eks.amazonaws.com/capacityType": "SPOT"}}}) in (403, 422)


def test_supervisor_may_write_only_scaling_suspension_and_scheduling_of_a_job(policies, k8s_namespace):
    plane = policies
    batch_admin = kubernetes.client.BatchV1Api(plane.api_client())
    batch_admin.create_namespaced_job(k8s_namespace, {
        "metadata": {"name": "train", "labels": {"team": "a"}},
        "spec": {"suspend": True, "parallelism": 2, "completions": 2, "completionMode": "Indexed",
                 "template": {"metadata": {"labels": {"app": "train"}},
                              "spec": {"restartPolicy": "Never", "containers": [{"name": "t", "image": "train:1"}]}}}})
    sup = kubernetes.client.BatchV1Api(plane.client_as("spotguard-supervisor"))

    def patch(body, dry_run=None):
        return _status(lambda: sup.patch_namespaced_job("train", k8s_namespace, body, dry_run=dry_run))

    # A suspended, never-started Job's template labels are mutable for the API server: only the
    # policy can refuse this one.
    template_label = {"spec": {"template": {"metadata": {"labels": {"app": "train", "x": "y"}}}}}
    wait_until(
        lambda: patch(template_label, dry_run="All") == 403, 30, "the Job policy enforced (template label denied)")
    assert patch({"spec": {"template": {"spec": {"containers": [{"name": "t", "image": "evil:1"}]}}}}) in (403, 422)
    assert patch({"spec": {"template": {"spec": {"schedulingGates": [{"name": "x"}]}}}}) == 403
    assert patch({"metadata": {"labels": {"team": "b"}}}) == 403
    assert patch({"spec": {"backoffLimit": 1}}) == 403
    # What the supervisor's code writes (and the fallback's scheduling fields):
    assert patch({"spec": {"template": {"spec": {"nodeSelector": {"capacity": "on-demand"},
                                                  "tolerations": [{"key": "spot", "operator": "Exists"}]}}}}) == 200
    assert patch({"spec": {"parallelism": 1}, "metadata": {"annotations": {names.ANN_STATUS: "{}"}}}) == 200
    assert patch({"spec": {"suspend": False, "parallelism": 2}}) == 200
    job = batch_admin.read_namespaced_job("train", k8s_namespace)
    assert job.spec.template.spec.node_selector == {"capacity": "on-demand"}
    assert job.spec.template.spec.containers[0].image == "train:1" and job.spec.backoff_limit != 1


def test_supervisor_may_write_only_scaling_suspension_and_scheduling_of_a_pytorchjob(policies, k8s_namespace):
    plane = policies
    install_pytorchjob_crd(plane)
    custom_admin = kubernetes.client.CustomObjectsApi(plane.api_client())
    args = ("kubeflow.org", "v1", k8s_namespace, "pytorchjobs")
    template = {"spec": {"containers": [{"name": "pytorch", "image": "train:1"}]}}
    wait_until(lambda: _status(lambda: custom_admin.create_namespaced_custom_object(*args, {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "pt"},
        "spec": {"runPolicy": {"suspend": False, "cleanPodPolicy": "None"},
                 "pytorchReplicaSpecs": {"Worker": {"replicas": 4, "restartPolicy": "OnFailure",
                                                    "template": template}}}})) == 200, 30, "PyTorchJob created")
    sup = kubernetes.client.CustomObjectsApi(plane.client_as("spotguard-supervisor"))

    def patch(body, dry_run=None):
        return _status(lambda: sup.patch_namespaced_custom_object(*args, "pt", body, dry_run=dry_run))

    image = {"spec": {"pytorchReplicaSpecs": {"Worker": {"template": {"spec": {"containers": [
        {"name": "pytorch", "image": "evil:1"}]}}}}}}
    wait_until(lambda: patch(image, dry_run="All") == 403, 30, "the PyTorchJob policy enforced (image change denied)")
    assert patch({"spec": {"runPolicy": {"cleanPodPolicy": "All"}}}) == 403
    assert patch({"spec": {"pytorchReplicaSpecs": {"Worker": {"restartPolicy": "Always"}}}}) == 403
    assert patch({"spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": template}}}}) == 403
    assert patch({"spec": {"elasticPolicy": {"maxReplicas": 99}}}) == 403
    assert patch({"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 3}}},
                  "metadata": {"annotations": {names.ANN_STATUS: "{}"}}}) == 200
    assert patch({"spec": {"runPolicy": {"suspend": True}}}) == 200
    assert patch({"spec": {"pytorchReplicaSpecs": {"Worker": {"template": {"spec": {
        "affinity": {"nodeAffinity": {}}}}}}}}) == 200


def test_certgen_fills_the_pre_created_secret_but_creates_none(control_plane):
    """certgen once could create a `kubernetes.io/service-account-token` Secret for any
    ServiceAccount and read the token. Now it may only get and patch the one Secret."""
    from spotguard.injector.certs import ensure_secret_and_ca_bundle

    plane = control_plane
    secret_docs = load_manifests(BASE_MANIFESTS / "injector" / "tls-secret.yaml")
    webhook_docs = load_manifests(BASE_MANIFESTS / "injector" / "webhook.yaml")
    (secret_name,) = [d["metadata"]["name"] for d in secret_docs]
    (webhook_name,) = [d["metadata"]["name"] for d in webhook_docs]
    core_admin = kubernetes.client.CoreV1Api(plane.api_client())
    admission = kubernetes.client.AdmissionregistrationV1Api(plane.api_client())
    plane.apply(secret_docs + webhook_docs, namespace=SPOTGUARD_NAMESPACE)
    api = plane.client_as("spotguard-certgen")
    try:
        core = kubernetes.client.CoreV1Api(api)
        token_secret = {"metadata": {"name": "stolen", "annotations": {
            "kubernetes.io/service-account.name": "spotguard-supervisor"}},
            "type": "kubernetes.io/service-account-token"}
        assert _status(lambda: core.create_namespaced_secret(SPOTGUARD_NAMESPACE, token_secret)) == 403
        assert _status(lambda: core.patch_namespaced_secret(secret_name, SPOTGUARD_NAMESPACE, {
            "type": "kubernetes.io/service-account-token"})) == 422  # a Secret's type is immutable
        assert ensure_secret_and_ca_bundle(api, SPOTGUARD_NAMESPACE, secret_name, "spotguard-injector",
                                           webhook_name) is True
        assert ensure_secret_and_ca_bundle(api, SPOTGUARD_NAMESPACE, secret_name, "spotguard-injector",
                                           webhook_name) is False
        data = core_admin.read_namespaced_secret(secret_name, SPOTGUARD_NAMESPACE).data
        bundle = admission.read_mutating_webhook_configuration(webhook_name).webhooks[0].client_config.ca_bundle
        assert base64.b64decode(bundle) == base64.b64decode(data["ca.crt"])
        assert all(base64.b64decode(data[k]).startswith(b"-----BEGIN") for k in ("tls.crt", "tls.key"))
    finally:
        api.close()
        admission.delete_mutating_webhook_configuration(webhook_name)
        core_admin.delete_namespaced_secret(secret_name, SPOTGUARD_NAMESPACE)
