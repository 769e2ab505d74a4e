"""Node marking against a Kubernetes API served over real HTTP (kmock): annotation, taint,
Events on the Node and opted-in pods, idempotence, withdrawal, 409s, an API server that goes
down mid-notice, cordon, and the restart / maintenance-reboot rules."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import timedelta

import kmock
import pytest

from spotguard.agent.node_marker import NodeMarker
from spotguard.backoff import Backoff
from spotguard.kube import load_api_client
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, Severity, notice_id, now_utc
from spotguard.wire.urgency import most_urgent

NODE = "node-a"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def make_notice(kind: Kind = Kind.RECLAIM, seconds: float | None = 120, tag: str = "1", source: str = "aws.spot",
                node: str = NODE) -> Notice:
    now = now_utc()
    return Notice(id=notice_id(source, node, kind.value, tag), kind=kind, source=source, node=node,
                  detected_at=now, deadline=None if seconds is None else now + timedelta(seconds=seconds),
                  detail={"tag": tag})


class Cluster:
    """A kmock Kubernetes API on 127.0.0.1 (port 0) that a test can stop and bring back."""

    def __init__(self, km: kmock.KubernetesEmulator):
        self.km = km
        self.server: kmock.Server | None = None
        self.port: int | None = None

    async def up(self) -> None:
        self.server = kmock.Server(self.km, port=self.port) if self.port else kmock.Server(self.km)
        await self.server.__aenter__()
        self.port = self.server.port

    async def down(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.__aexit__(None, None, None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        return load_api_client(host=self.url)

    def node(self, name: str = NODE) -> dict:
        return self.km.objects["v1/nodes", None, name].raw

    def events(self) -> list[dict]:
        return [obj.raw for (res, _, _), obj in self.km.objects.items()
                if res.plural == "events" and not obj.deleted]

    def events_about(self, kind: str, name: str) -> list[dict]:
        return [e for e in self.events() if e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == name]

    def requests(self, method: str, path_part: str) -> list:
        return [r for r in self.km[method] if path_part in r.url.path]

    async def create(self, kind: str, body: dict, namespace: str | None = None) -> None:
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.client())
        if kind == "node":
            await asyncio.to_thread(core.create_node, body)
        else:
            await asyncio.to_thread(core.create_namespaced_pod, namespace, body)


@pytest.fixture
async def cluster():
    async with kmock.KubernetesEmulator() as km:
        for resource in ("v1/nodes", "v1/pods", "v1/events"):  # a real server lists empty ones too
            km.resources[resource] = {}
        c = Cluster(km)
        await c.up()
        try:
            yield c
        finally:
            await c.down()


def pod(name: str, node: str, inject: bool = True, phase: str = "Running", namespace: str = "team-a") -> dict:
    """A pod as a real API server returns it (kmock stores the body as sent: namespace included)."""
    labels = {"spotguard.io/inject": "true"} if inject else {"app": "x"}
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels, "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": phase}}


def node_info(boot_id: str) -> dict:
    return {"nodeInfo": {"bootID": boot_id, "architecture": "amd64", "containerRuntimeVersion": "containerd://2",
                         "kernelVersion": "6.1", "kubeProxyVersion": "", "kubeletVersion": "v1.33",
                         "machineID": "m", "operatingSystem": "linux", "osImage": "x", "systemUUID": "u"}}


async def node_with(cluster: Cluster, **fields) -> None:
    body = {"metadata": {"name": NODE, "uid": "uid-node-a", "resourceVersion": "7",
                         "annotations": fields.pop("annotations", {})},
            "spec": {"taints": fields.pop("taints", [GPU_TAINT])}, **fields}
    await cluster.create("node", body)


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.02)


def make_marker(cluster: Cluster, **kwargs) -> NodeMarker:
    kwargs.setdefault("backoff", Backoff(base=0.05, cap=0.3))
    kwargs.setdefault("request_timeout", 3.0)
    return NodeMarker(cluster.client(), NODE, **kwargs)


async def synced(marker: NodeMarker, timeout: float = 10.0) -> None:
    await until(lambda: marker.in_sync, timeout, "marker in sync")


def our_taints(node: dict) -> list[dict]:
    return [t for t in node["spec"].get("taints") or [] if t["key"] == names.TAINT_RECLAIM]


# ---- marking -----------------------------------------------------------------------------------
async def test_marks_annotation_taint_and_events_on_node_and_opted_in_pods(cluster):
    await node_with(cluster)
    await cluster.create("pod", pod("train-0", NODE), "team-a")
    await cluster.create("pod", pod("train-elsewhere", "node-b"), "team-a")
    await cluster.create("pod", pod("web-0", NODE, inject=False, namespace="team-b"), "team-b")
    await cluster.create("pod", pod("done-0", NODE, phase="Succeeded"), "team-a")
    reclaim = make_notice(Kind.RECLAIM, 120, "r")
    rebalance = make_notice(Kind.REBALANCE, None, "b", source="aws.rebalance")
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([rebalance, reclaim])
        await synced(marker)
    finally:
        await marker.stop()
    node = cluster.node()
    assert Notice.from_json(node["metadata"]["annotations"][names.ANN_NOTICE]) == reclaim  # earliest deadline
    reclaim_taint = {"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"}
    assert node["spec"]["taints"] == [GPU_TAINT, reclaim_taint]
    assert "unschedulable" not in node["spec"]  # cordon is off by default
    node_events = cluster.events_about("Node", NODE)
    assert sorted(e["message"].split("id ")[-1] for e in node_events) == sorted([reclaim.id, rebalance.id])
    assert all(e["reason"] == names.EVENT_NOTICE and e["type"] == "Warning" and e["metadata"]["namespace"] == "default"
               and e["involvedObject"]["uid"] == "uid-node-a" for e in node_events)
    pod_events = cluster.events_about("Pod", "train-0")
    assert len(pod_events) == 2 and {e["metadata"]["namespace"] for e in pod_events} == {"team-a"}
    assert not cluster.events_about("Pod", "train-elsewhere") and not cluster.events_about("Pod", "web-0")
    assert not cluster.events_about("Pod", "done-0")
    assert marker.stats["marked"] == 1 and marker.stats["events"] == 4 and marker.stats["errors"] == 0
    # the product asks the API server for this node's pods, as the documented API expects
    lists = cluster.requests("get", "/pods")
    assert lists and all(r.params.get("fieldSelector") == f"spec.nodeName={NODE}" for r in lists)
    # the patch carried the resourceVersion read, so a real API server would detect a conflict
    patches = cluster.requests("patch", f"/nodes/{NODE}")
    assert patches[0].data["metadata"]["resourceVersion"] == "7"
    assert patches[0].headers["Content-Type"] == "application/strategic-merge-patch+json"


async def test_moved_deadline_and_a_more_urgent_notice_update_the_marks(cluster):
    await node_with(cluster)
    maintenance = make_notice(Kind.MAINTENANCE, 3600, "m", source="aws.maintenance")
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([maintenance])
        await synced(marker)
        assert our_taints(cluster.node())[0]["value"] == "maintenance"
        moved = maintenance.with_deadline(maintenance.deadline - timedelta(minutes=30))
        marker.notify([moved])
        await synced(marker)
        assert Notice.from_json(cluster.node()["metadata"]["annotations"][names.ANN_NOTICE]).deadline == moved.deadline
        reclaim = make_notice(Kind.RECLAIM, 30, "r")
        marker.notify([moved, reclaim])
        await synced(marker)
    finally:
        await marker.stop()
    node = cluster.node()
    assert Notice.from_json(node["metadata"]["annotations"][names.ANN_NOTICE]).id == reclaim.id
    assert our_taints(node) == [{"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"}]
    assert len(cluster.events_about("Node", NODE)) == 2  # one per notice id, not per change


async def test_resync_is_idempotent_also_across_a_restart(cluster):
    await node_with(cluster)
    await cluster.create("pod", pod("train-0", NODE), "team-a")
    notice = make_notice()
    first = make_marker(cluster)
    await first.start()
    try:
        first.notify([notice])
        await synced(first)
        patches = len(cluster.requests("patch", "/nodes/"))
        for _ in range(3):
            first.notify([notice])
            await synced(first)
    finally:
        await first.stop()  # keeps the marks
    second = make_marker(cluster)  # the agent restarted: the same notice comes back
    await second.start()
    try:
        second.notify([notice])
        await synced(second)
    finally:
        await second.stop()
    node = cluster.node()
    assert len(our_taints(node)) == 1 and node["spec"]["taints"][0] == GPU_TAINT
    assert len(cluster.requests("patch", "/nodes/")) == patches == 1  # nothing to change, nothing sent
    assert len(cluster.events_about("Node", NODE)) == 1 and len(cluster.events_about("Pod", "train-0")) == 1
    assert second.stats["events"] == 0 and second.stats["marked"] == 0


async def test_withdrawn_notice_removes_taint_and_annotation_keeps_other_taints(cluster):
    await node_with(cluster)
    notice = make_notice()
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([notice])
        await synced(marker)
        assert our_taints(cluster.node())
        marker.notify([])
        await synced(marker)
    finally:
        await marker.stop()
    node = cluster.node()
    assert names.ANN_NOTICE not in node["metadata"]["annotations"]
    assert node["spec"]["taints"] == [GPU_TAINT]
    assert marker.stats["unmarked"] == 1


# ---- failures ----------------------------------------------------------------------------------
async def test_conflict_409_rereads_and_retries_keeping_the_concurrent_change(cluster):
    await node_with(cluster)
    concurrent = {"key": "example.com/maintenance", "effect": "NoExecute"}
    answered: list = []

    def first_patch_conflicts(request):
        if answered:
            return None  # fall through to the emulator
        answered.append(request)
        # Another writer changed the Node first (new taint, new resourceVersion) and won.
        obj = cluster.km.objects["v1/nodes", None, NODE]
        obj.patch({"metadata": {"resourceVersion": "8", "annotations": {names.ANN_NOTICE: None}},
                   "spec": {"taints": [GPU_TAINT, concurrent]}})
        return kmock.KubernetesError(status=409, reason="Conflict",
                                     message="Operation cannot be fulfilled on nodes: the object has been modified")

    cluster.km["patch", kmock.resource("v1/nodes")] << first_patch_conflicts
    notice = make_notice()
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([notice])
        await synced(marker)
    finally:
        await marker.stop()
    node = cluster.node()
    assert marker.stats["conflicts"] == 1 and marker.stats["errors"] == 0
    patches = cluster.requests("patch", "/nodes/")
    assert [p.data["metadata"]["resourceVersion"] for p in patches] == ["7", "8"]  # re-read before retrying
    assert node["spec"]["taints"] == [GPU_TAINT, concurrent, {"key": names.TAINT_RECLAIM, "value": "reclaim",
                                                             "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"][names.ANN_NOTICE] == notice.to_json()


async def test_api_server_down_during_a_notice_is_retried_until_marked(cluster):
    await node_with(cluster)
    await cluster.create("pod", pod("train-0", NODE), "team-a")
    await cluster.down()  # the API server is unreachable when the notice comes
    first, second = make_notice(Kind.REBALANCE, None, "b"), make_notice(Kind.RECLAIM, 60, "r")
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([first])
        await until(lambda: marker.stats["errors"] >= 2, what="failed attempts")
        marker.notify([first, second])  # the state changes while the server is down
        await until(lambda: marker.stats["errors"] >= 4, what="more failed attempts")
        assert not marker.in_sync
        await cluster.up()  # same port: the server is back
        await synced(marker, timeout=15)
    finally:
        await marker.stop()
    node = cluster.node()
    assert node["metadata"]["annotations"][names.ANN_NOTICE] == second.to_json()
    assert our_taints(node)[0]["value"] == "reclaim"
    assert len(cluster.events_about("Node", NODE)) == 2 and len(cluster.events_about("Pod", "train-0")) == 2


async def test_api_errors_on_events_are_retried(cluster):
    await node_with(cluster)
    await cluster.create("pod", pod("train-0", NODE), "team-a")
    failures: list = []

    def fail_twice(request):
        if len(failures) < 2:
            failures.append(request)
            return kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="etcd is busy")
        return None

    cluster.km["get", kmock.resource("v1/pods")] << fail_twice
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([make_notice()])
        await synced(marker)
    finally:
        await marker.stop()
    assert marker.stats["errors"] == 2 and len(failures) == 2
    assert len(cluster.events_about("Pod", "train-0")) == 1 and len(cluster.events_about("Node", NODE)) == 1


async def test_missing_node_is_an_error_retried(cluster):
    marker = make_marker(cluster)
    await marker.start()
    try:
        marker.notify([make_notice()])
        await until(lambda: marker.stats["errors"] >= 2)
        assert "404" in (marker.last_error or "")
        await node_with(cluster)  # the Node registers late
        await synced(marker)
    finally:
        await marker.stop()
    assert our_taints(cluster.node())


# ---- cordon ------------------------------------------------------------------------------------
async def test_cordon_on_and_off(cluster):
    await node_with(cluster)
    marker = make_marker(cluster, cordon=True)
    await marker.start()
    try:
        marker.notify([make_notice()])
        await synced(marker)
        node = cluster.node()
        assert node["spec"]["unschedulable"] is True and node["metadata"]["annotations"][names.ANN_CORDONED] == "true"
        marker.notify([])
        await synced(marker)
    finally:
        await marker.stop()
    node = cluster.node()
    assert not node["spec"].get("unschedulable") and names.ANN_CORDONED not in node["metadata"]["annotations"]


async def test_a_cordon_we_did_not_make_is_left_alone(cluster):
    await node_with(cluster, spec={"unschedulable": True, "taints": [GPU_TAINT]})
    marker = make_marker(cluster, cordon=True)
    await marker.start()
    try:
        marker.notify([make_notice()])
        await synced(marker)
        assert names.ANN_CORDONED not in cluster.node()["metadata"]["annotations"]
        marker.notify([])
        await synced(marker)
    finally:
        await marker.stop()
    assert cluster.node()["spec"]["unschedulable"] is True


# ---- restarts ----------------------------------------------------------------------------------
def marked_annotations(notice: Notice, boot_id: str | None = None) -> dict:
    ann = {names.ANN_NOTICE: notice.to_json()}
    if boot_id:
        ann[names.ANN_NOTICE_BOOT_ID] = boot_id
    return ann


def our_taint(kind: str) -> dict:
    return {"key": names.TAINT_RECLAIM, "value": kind, "effect": "NoSchedule"}


async def test_maintenance_reboot_cleans_up_at_start(cluster):
    past = make_notice(Kind.MAINTENANCE, -600, "m", source="aws.maintenance")
    await node_with(cluster, annotations=marked_annotations(past, "boot-1"),
                    taints=[GPU_TAINT, our_taint("maintenance")], status=node_info("boot-2"))
    marker = make_marker(cluster, startup_grace=60)
    await marker.start()  # no notify() at all: the rule applies on start
    try:
        await until(lambda: names.ANN_NOTICE not in cluster.node()["metadata"]["annotations"], what="cleanup")
    finally:
        await marker.stop()
    node = cluster.node()
    assert node["spec"]["taints"] == [GPU_TAINT] and names.ANN_NOTICE_BOOT_ID not in node["metadata"]["annotations"]


async def test_no_cleanup_without_a_reboot_or_while_the_notice_is_live(cluster):
    past = make_notice(Kind.MAINTENANCE, -600, "m", source="aws.maintenance")
    await node_with(cluster, annotations=marked_annotations(past, "boot-1"),
                    taints=[GPU_TAINT, our_taint("maintenance")], status=node_info("boot-1"))
    marker = make_marker(cluster, startup_grace=60)
    await marker.start()
    try:
        await asyncio.sleep(0.5)  # same boot: the node did not reboot yet; nothing known yet
        assert cluster.node()["metadata"]["annotations"][names.ANN_NOTICE] == past.to_json()
        marker.notify([past])  # the source still reports it: it stays
        await synced(marker)
    finally:
        await marker.stop()
    assert cluster.node()["metadata"]["annotations"][names.ANN_NOTICE] == past.to_json()
    assert not cluster.requests("patch", "/nodes/")


async def test_inherited_mark_waits_for_the_startup_grace(cluster):
    old = make_notice(Kind.RECLAIM, 120, "old")
    await node_with(cluster, annotations=marked_annotations(old), taints=[GPU_TAINT, our_taint("reclaim")])
    marker = make_marker(cluster, startup_grace=1.0)
    await marker.start()
    try:
        marker.notify([])  # the restarted agent's sources have not reported yet
        await asyncio.sleep(0.4)
        assert names.ANN_NOTICE in cluster.node()["metadata"]["annotations"] and not marker.in_sync
        await synced(marker)  # the grace passed and the notice did not come back: cleaned
    finally:
        await marker.stop()
    assert cluster.node()["spec"]["taints"] == [GPU_TAINT]


async def test_event_posts_a_node_event(cluster):
    await node_with(cluster)
    marker = make_marker(cluster)
    assert await marker.event("GpuWarning", "GPU-1: remap pending") is True
    assert await marker.event("GpuWarning", "GPU-1: remap pending again", type="Normal") is True
    events = cluster.events_about("Node", NODE)
    assert [e["reason"] for e in events] == ["GpuWarning", "GpuWarning"] and events[1]["type"] == "Normal"
    await cluster.down()
    assert await marker.event("GpuWarning", "lost") is False and marker.stats["errors"] == 1


async def test_warn_posts_without_blocking_and_rate_limits(cluster):
    await node_with(cluster)
    marker = make_marker(cluster)
    marker.warn("remap_pending", "GPU GPU-1: remap pending")
    marker.warn("remap_pending", "GPU GPU-1: remap pending")  # the same text again: not posted
    marker.warn("thermal_slowdown", "GPU GPU-1: 88C")
    await until(lambda: marker.stats["events"] == 2)
    await marker.stop()
    assert sorted(e["reason"] for e in cluster.events_about("Node", NODE)) == ["remap_pending", "thermal_slowdown"]


def test_most_urgent():
    a, b, c = make_notice(seconds=None, tag="a"), make_notice(seconds=30, tag="b"), make_notice(seconds=10, tag="c")
    assert most_urgent([a, b, c]) is c and most_urgent([a]) is a and most_urgent([]) is None
    assert json.loads(c.to_json())["id"] == c.id


async def test_an_advisory_posts_one_warning_event_and_never_marks(cluster):
    """A GPU warning is an advisory notice: a Warning Event on the Node once per lifetime, and no
    annotation, taint, cordon or SpotguardNotice Event, even beside an actionable notice."""
    await node_with(cluster)
    await cluster.create("pod", pod("train-0", NODE), "team-a")
    now = now_utc()
    advisory = Notice(id=notice_id("gpu", NODE, "GPU-1", "remap_pending", "advisory"), kind=Kind.GPU_FAULT,
                      source="gpu", node=NODE, detected_at=now, deadline=None, severity=Severity.ADVISORY,
                      detail={"gpu": "GPU-1", "signal": "remap_pending", "cordon": True})
    marker = make_marker(cluster, cordon=True)
    await marker.start()
    try:
        marker.notify([advisory])
        await until(lambda: marker.stats["events"] >= 1, what="the advisory's Event")
        marker.notify([advisory])  # still live: nothing new
        await synced(marker)
        await asyncio.sleep(0.3)
        node = cluster.node()
        assert names.ANN_NOTICE not in (node["metadata"].get("annotations") or {})
        assert our_taints(node) == [] and "unschedulable" not in node["spec"]
        events = cluster.events_about("Node", NODE)
        assert len(events) == 1 and events[0]["type"] == "Warning" and events[0]["reason"] != names.EVENT_NOTICE
        assert not cluster.events_about("Pod", "train-0")

        reclaim = make_notice(Kind.RECLAIM, 120, "r")  # an actionable notice beside it is marked as usual
        marker.notify([advisory, reclaim])
        await synced(marker)
        node = cluster.node()
        assert Notice.from_json(node["metadata"]["annotations"][names.ANN_NOTICE]) == reclaim
        assert len(cluster.events_about("Node", NODE)) == 2
    finally:
        await marker.stop()


def test_the_mark_shows_the_first_to_depart_whatever_the_jobs_horizon():
    """The supervisor reads the one marked notice, each job with its own horizon: a GPU fault
    (no deadline: any moment) must not hide behind a maintenance an hour out (the plain urgency
    order, earliest deadline first, would mark the maintenance), and a maintenance 300 s out not
    behind an advisory due in 50 s (a job whose horizon is 600 s departs on the maintenance)."""
    from spotguard.agent.node_marks import marked_notice, plan_marks

    fault = make_notice(Kind.GPU_FAULT, None, "g", source="nvml")
    maintenance = make_notice(Kind.MAINTENANCE, 3600, "m", source="aws.maintenance")
    rebalance = make_notice(Kind.REBALANCE, None, "r", source="aws.rebalance")
    soon = make_notice(Kind.MAINTENANCE, 300, "s", source="aws.maintenance")
    advisory = dataclasses.replace(make_notice(Kind.RECLAIM, 50, "a"), severity=Severity.ADVISORY)
    now = now_utc()
    assert most_urgent([fault, maintenance]) is maintenance
    assert marked_notice([maintenance, fault]) is fault
    assert marked_notice([rebalance, maintenance]) is maintenance
    assert marked_notice([advisory, soon]) is soon and marked_notice([soon, maintenance]) is soon
    assert marked_notice([]) is None
    plan = plan_marks({"metadata": {"name": NODE}, "spec": {}}, [maintenance, fault], mine=set(), cordon=False,
                      grace_left=0.0, now=now)
    assert plan.marked == fault.id and plan.patch["spec"]["taints"][0]["value"] == "gpu-fault"
