"""The injector's webhook called by a real kube-apiserver over TLS: the webhook server on
127.0.0.1 with a certificate from `injector.certs` for that address, registered with the
selectors of daemonset/base/injector/webhook.yaml but a `clientConfig.url` (no Service endpoints
without a kubelet) and the CA as caBundle, limited to the test's namespace (the configuration
is cluster-wide and the control plane is shared). The API server validates the mutated pods."""
from __future__ import annotations

import asyncio
import base64
import copy

import kubernetes
import pytest
from aiohttp import web

from spotguard.injector.certs import make_certificate
from spotguard.injector.patch import SIDECAR_NAME, InjectorConfig
from spotguard.injector.server import make_app, tls_context
from spotguard.wire import names
from tests.control_plane import BASE_MANIFESTS, load_manifests
from tests.k8s_world import wait_service_account, wait_until

pytestmark = pytest.mark.k8s


def _webhook_configuration(name: str, url: str, ca_pem: bytes, namespace: str) -> dict:
    doc = copy.deepcopy(load_manifests(BASE_MANIFESTS / "injector" / "webhook.yaml")[0])
    doc["metadata"]["name"] = name
    hook = doc["webhooks"][0]
    hook["clientConfig"] = {"url": url, "caBundle": base64.b64encode(ca_pem).decode()}
    hook["namespaceSelector"]["matchExpressions"].append(
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [namespace]})
    assert hook["failurePolicy"] == "Ignore"
    return doc


def _pod(name: str, inject: bool) -> dict:
    labels = {"spotguard.io/inject": "true"} if inject else {"app": "web"}
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "train", "image": "train:1"}]}}


def _sidecars(pod) -> list[str]:
    return [c.name for c in pod.spec.init_containers or [] if c.name == SIDECAR_NAME]


async def test_webhook_injects_through_the_real_api_server(control_plane, k8s_namespace, tmp_path):
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    admission = kubernetes.client.AdmissionregistrationV1Api(api)
    tls = make_certificate(["localhost"], ["127.0.0.1"], days=1)
    (tmp_path / "tls.crt").write_bytes(tls.cert_pem)
    (tmp_path / "tls.key").write_bytes(tls.key_pem)
    runner = web.AppRunner(make_app(InjectorConfig(image="spotguard:test")))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls_context(str(tmp_path / "tls.crt"),
                                                                       str(tmp_path / "tls.key")))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    name = f"spotguard-injector-{k8s_namespace}"[:63]
    await asyncio.to_thread(admission.create_mutating_webhook_configuration,
                            _webhook_configuration(name, f"https://127.0.0.1:{port}/mutate", tls.ca_pem, k8s_namespace))
    try:
        await asyncio.to_thread(wait_service_account, control_plane, k8s_namespace)
        labelled = await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, _pod("train-0", True))
        assert _sidecars(labelled) == [SIDECAR_NAME]
        assert labelled.metadata.annotations[names.ANN_INJECTED] == "true"
        plain = await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, _pod("web-0", False))
        assert not _sidecars(plain) and names.ANN_INJECTED not in (plain.metadata.annotations or {})

        template = _pod("unused", True)
        template["spec"]["restartPolicy"] = "Never"
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
               "spec": {"parallelism": 2, "completions": 2, "completionMode": "Indexed",
                        "template": {"metadata": {"labels": template["metadata"]["labels"]},
                                     "spec": template["spec"]}}}
        await asyncio.to_thread(batch.create_namespaced_job, k8s_namespace, job)

        def job_pods():
            pods = core.list_namespaced_pod(k8s_namespace, label_selector="job-name=train").items
            return pods if len(pods) == 2 else None
        pods = await asyncio.to_thread(wait_until, job_pods, 60, "the Job controller's pods")
        assert all(_sidecars(p) == [SIDECAR_NAME] for p in pods)

        await runner.cleanup()  # the webhook is down: failurePolicy Ignore admits the pod as it is
        down = await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, _pod("train-1", True))
        assert not _sidecars(down)
    finally:
        await runner.cleanup()
        await asyncio.to_thread(admission.delete_mutating_webhook_configuration, name)
