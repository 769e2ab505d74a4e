"""supervisor/sidecar_watch.py: which pods asked for the sidecar and run without it (a table), the
gauge per namespace, and one Warning Event per pod, posted by the leader only, tried again after a
refusal or an error. The real API server's part: tests/test_k8s_sidecar_watch.py."""
from __future__ import annotations

import copy

import pytest

from spotguard.kube.api import ApiError
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.sidecar_watch import EVENT_SIDECAR_MISSING, MissingSidecars, missing_sidecar, warning_message
from spotguard.wire import names
from spotguard.wire.injection import SIDECAR_NAME


def pod(name: str = "train-0", namespace: str = "ml", uid: str = "0a1b2c3d-0000-4000-8000-00000000000a",
        inject: bool = True, **changes) -> dict:
    obj = {"metadata": {"name": name, "namespace": namespace, "uid": uid,
                        "labels": {names.LABEL_INJECT: "true"} if inject else {"app": "web"}},
           "spec": {"containers": [{"name": "train", "image": "train:1"}]},
           "status": {"phase": "Pending"}}
    for path, value in changes.items():
        target = obj
        *parents, last = path.split("__")
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value
    return obj


INJECTED = {"spec__initContainers": [{"name": SIDECAR_NAME, "image": "spotguard:1", "restartPolicy": "Always"}]}


@pytest.mark.parametrize("obj, missing", [
    (pod(), True),
    (pod(status__phase="Running"), True),
    (pod(inject=False), False),
    (pod(**INJECTED), False),
    (pod(metadata__annotations={names.ANN_INJECTED: "true"}), False),
    (pod(namespace="kube-system"), False),  # the webhook leaves these namespaces out
    (pod(namespace="spotguard"), False),
    (pod(status__phase="Succeeded"), False),
    (pod(status__phase="Failed"), False),
    (pod(metadata__deletionTimestamp="2026-11-28T10:00:00Z"), False),
    (pod(metadata__labels={names.LABEL_INJECT: "false"}), False),
], ids=["pending", "running", "not-labelled", "sidecar", "annotated", "kube-system", "spotguard", "succeeded",
        "failed", "deleting", "label-false"])
def test_which_pods_miss_the_sidecar(obj, missing):
    assert missing_sidecar(obj) is missing


def test_the_message_says_what_the_pod_lacks_and_what_to_do():
    assert warning_message(pod()) == (
        "this pod asked for the spotguard sidecar (label spotguard.io/inject=true) but was admitted without it: "
        "the injector's webhook did not answer (failurePolicy Ignore). No reclaim notice reaches its ranks, no "
        "preStop hook holds its termination, and its grace period is 30s. Once the spotguard-injector "
        "Deployment is ready, delete the pod: its controller makes it again, with the sidecar.")
    assert "grace period is 5s." in warning_message(pod(spec__terminationGracePeriodSeconds=5))


class Events:
    """A stand-in for JobEffects.create_event: records each Event; `leader` False posts nothing,
    `fail` raises the API's error once per pod."""

    def __init__(self) -> None:
        self.posted: list[dict] = []
        self.leader = True
        self.fail: set[str] = set()

    async def __call__(self, obj, *, key, reason, message, event_type, action) -> bool:
        if not self.leader:
            return False
        name = obj["metadata"]["name"]
        if name in self.fail:
            self.fail.discard(name)
            raise ApiError(500, "etcdserver: request timed out")
        self.posted.append({"kind": obj["kind"], "apiVersion": obj["apiVersion"], "name": name, "key": key,
                            "reason": reason, "type": event_type})
        return True


def gauge_values(metrics: SupervisorMetrics) -> dict[str, float]:
    family = metrics.pods_missing_sidecar
    return {key[0]: value for key, value in family._values.items()}


async def test_one_warning_per_pod_from_the_leader_and_the_gauge_per_namespace():
    metrics, events = SupervisorMetrics(), Events()
    watch = MissingSidecars(metrics.pods_missing_sidecar, events)
    other_ns = pod("train-1", "vision", uid="ffff0000-0000-4000-8000-000000000001")
    assert watch.observe("SYNC", [pod(), other_ns, pod("web", inject=False, uid="u3"), pod("ok", uid="u4", **INJECTED)])
    assert gauge_values(metrics) == {"ml": 1, "vision": 1}

    events.leader = False  # a follower keeps the gauge and posts nothing
    await watch.warn()
    assert events.posted == []
    events.leader = True
    await watch.warn()
    await watch.warn()  # already warned: nothing more
    assert sorted(events.posted, key=lambda e: e["name"]) == [
        {"kind": "Pod", "apiVersion": "v1", "name": "train-0", "key": "sidecar-missing-0a1b2c3d00004000",
         "reason": EVENT_SIDECAR_MISSING, "type": "Warning"},
        {"kind": "Pod", "apiVersion": "v1", "name": "train-1", "key": "sidecar-missing-ffff000000004000",
         "reason": EVENT_SIDECAR_MISSING, "type": "Warning"}]

    running = copy.deepcopy(pod())
    running["status"]["phase"] = "Running"
    assert not watch.observe("MODIFIED", running)  # still missing, already warned
    assert not watch.observe("DELETED", other_ns)
    assert gauge_values(metrics) == {"ml": 1}
    assert not watch.observe("MODIFIED", pod(status__phase="Succeeded"))
    assert gauge_values(metrics) == {}

    again = pod(uid="0a1b2c3d-1111-4000-8000-00000000000b")  # made again under the same name: a new pod
    assert watch.observe("ADDED", again)
    await watch.warn()
    assert events.posted[-1]["key"] == "sidecar-missing-0a1b2c3d11114000"


async def test_a_failed_post_is_tried_again():
    metrics, events = SupervisorMetrics(), Events()
    watch = MissingSidecars(metrics.pods_missing_sidecar, events)
    events.fail.add("train-0")
    watch.observe("ADDED", pod())
    await watch.warn()
    assert events.posted == []
    await watch.warn()
    assert [e["name"] for e in events.posted] == ["train-0"]


async def test_follow_posts_in_a_task_on_the_loop():
    import asyncio

    metrics, events = SupervisorMetrics(), Events()
    watch = MissingSidecars(metrics.pods_missing_sidecar, events)
    watch.follow("ADDED", pod())
    watch.follow("ADDED", pod("web", inject=False, uid="u2"))
    for _ in range(100):
        if events.posted:
            break
        await asyncio.sleep(0.01)
    assert [e["name"] for e in events.posted] == ["train-0"]
