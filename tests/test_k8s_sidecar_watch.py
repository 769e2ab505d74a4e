"""A pod that asked for the sidecar while the injector was not ready, on a real kube-apiserver: the
webhook of daemonset/base/injector/webhook.yaml (failurePolicy Ignore), limited to the test's
namespace, points at a port nothing listens on, so the API server admits the labelled pod
unchanged. The supervisor, as its own ServiceAccount under the RBAC of daemonset/base (no rule
added for this), posts one Warning Event on that pod and counts it in
`spotguard_pods_missing_sidecar`; a pod with the sidecar and an unlabelled pod get none; once the
pod is gone the gauge is back to 0."""
from __future__ import annotations

import asyncio
import copy
import logging

import kubernetes
import pytest

from spotguard.kube.api import Kube
from spotguard.processes import free_port
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.sidecar_watch import EVENT_SIDECAR_MISSING
from spotguard.wire import names
from spotguard.wire.injection import SIDECAR_NAME
from tests.control_plane import BASE_MANIFESTS, load_manifests
from tests.k8s_world import refusals, wait_service_account, wait_until

pytestmark = pytest.mark.k8s
SUPERVISOR = "spotguard-supervisor"


def unanswered_webhook(name: str, namespace: str) -> dict:
    """The shipped webhook, limited to `namespace`, calling a port nothing listens on."""
    doc = copy.deepcopy(load_manifests(BASE_MANIFESTS / "injector" / "webhook.yaml")[0])
    doc["metadata"]["name"] = name
    hook = doc["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{free_port()}/mutate"}
    hook["namespaceSelector"]["matchExpressions"].append(
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [namespace]})
    return doc


def pod(name: str, labels: dict, **spec) -> dict:
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "train", "image": "train:1"}],
                     **spec}}


async def test_a_pod_admitted_without_the_sidecar_gets_a_warning_and_is_counted(control_plane, k8s_namespace,
                                                                               caplog):
    caplog.set_level(logging.INFO)
    api = control_plane.api_client()
    core = kubernetes.client.CoreV1Api(api)
    admission = kubernetes.client.AdmissionregistrationV1Api(api)
    webhook = f"spotguard-injector-down-{k8s_namespace}"[:63]
    await asyncio.to_thread(admission.create_mutating_webhook_configuration,
                            unanswered_webhook(webhook, k8s_namespace))
    controller = Controller(Kube(control_plane.client_as(SUPERVISOR)),
                            ControllerConfig(identity="sup-sidecars", namespace=k8s_namespace, resync=30.0))
    await controller.start()
    try:
        await asyncio.to_thread(wait_service_account, control_plane, k8s_namespace)
        inject = {names.LABEL_INJECT: "true"}
        bare = await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, pod("train-0", inject))
        assert not bare.spec.init_containers  # the webhook did not answer: admitted as it was
        sidecar = [{"name": SIDECAR_NAME, "image": "spotguard:1", "restartPolicy": "Always"}]
        await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace,
                                pod("train-1", inject, initContainers=sidecar))  # as an injected pod is
        await asyncio.to_thread(core.create_namespaced_pod, k8s_namespace, pod("web-0", {"app": "web"}))

        def warnings():
            return [e for e in core.list_namespaced_event(k8s_namespace).items if e.reason == EVENT_SIDECAR_MISSING]
        [event] = await asyncio.to_thread(wait_until, warnings, 30, "the Warning Event on train-0")
        involved = event.involved_object
        assert (involved.kind, involved.name, involved.uid) == ("Pod", "train-0", bare.metadata.uid)
        assert event.type == "Warning" and "admitted without it" in event.message
        assert "grace period is 0s" in event.message
        gauge = controller.metrics.pods_missing_sidecar
        assert gauge.value(namespace=k8s_namespace) == 1
        assert f'spotguard_pods_missing_sidecar{{namespace="{k8s_namespace}"}} 1' in controller.metrics.render()

        await asyncio.to_thread(core.delete_namespaced_pod, "train-0", k8s_namespace, grace_period_seconds=0)
        await asyncio.to_thread(wait_until, lambda: gauge.value(namespace=k8s_namespace) == 0, 30,
                                "the gauge back to 0")
        # every pod's events have been seen by now: still the one Event, on train-0
        assert [e.involved_object.name for e in warnings()] == ["train-0"]
    finally:
        await controller.stop()
        await asyncio.to_thread(admission.delete_mutating_webhook_configuration, webhook)
    assert not refusals(caplog)
