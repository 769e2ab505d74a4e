"""The Kubernetes node source against kmock's real HTTP API server, through the official client."""
from __future__ import annotations

import asyncio
import threading
import uuid

import kmock
import pytest
from kubernetes import client

from spotguard.agent.sources.k8s_node import NodeSource, drain_signals
from spotguard.backoff import Backoff
from spotguard.kube import load_api_client
from spotguard.wire.notice import Kind, Notice
from spotguard.wire.withdrawal import Withdrawal
from tests.source_runner import RunningSource

NODES = kmock.resource("", "v1", "nodes")
AUTOSCALER = "ToBeDeletedByClusterAutoscaler"


class Cluster:
    """A kmock API server plus a CoreV1Api to change Nodes with (each call in a thread)."""

    def __init__(self, km: kmock.KubernetesEmulator, url: str):
        self.km = km
        self.url = url
        self.api_client = load_api_client(host=url)
        self.api = client.CoreV1Api(self.api_client)

    async def create_node(self, name: str, spec: dict | None = None, uid: str | None = None) -> str:
        """Creates a Node; returns its uid (kmock keeps the one given: a real API server makes
        a new one for each Node object, which this emulates with a random one)."""
        uid = uid or str(uuid.uuid4())
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}, "spec": spec or {}}
        await asyncio.to_thread(self.api.create_node, body)
        return uid

    async def patch_spec(self, name: str, spec: dict) -> None:
        await asyncio.to_thread(self.api.patch_node, name, {"spec": spec})

    async def delete_node(self, name: str) -> None:
        await asyncio.to_thread(self.api.delete_node, name)

    def source(self, node: str = "n1", **kwargs) -> NodeSource:
        kwargs.setdefault("backoff", Backoff(base=0.05, cap=0.2))
        return NodeSource(self.api_client, node, **kwargs)


@pytest.fixture
async def cluster():
    async with kmock.KubernetesEmulator() as km, kmock.Server(km) as srv:
        km.resources[NODES] = {"kind": "Node", "namespaced": False}  # known before any Node exists
        c = Cluster(km, str(srv.url).rstrip("/"))
        try:
            yield c
        finally:
            await asyncio.to_thread(c.api_client.close)


@pytest.fixture
async def run_source():
    """`running = run_source(source)`: run() in a task; cancelled (and its thread checked) after."""
    started: list[RunningSource] = []

    def start(source: NodeSource) -> RunningSource:
        running = RunningSource(source)
        started.append(running)
        return running

    yield start
    for running in started:
        if not running.task.done():
            running.task.cancel()
        await asyncio.gather(running.task, return_exceptions=True)


def watcher_threads(node: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"k8s-node-watch:{node}" and t.is_alive()]


def taint(key: str, value: str | None = None, effect: str = "NoSchedule") -> dict:
    t = {"key": key, "effect": effect}
    if value is not None:
        t["value"] = value
    return t


def is_notice(update) -> bool:
    return isinstance(update, Notice)


SIGNALS = [
    ({"taints": [taint("karpenter.sh/disrupted")]}, "karpenter.sh/disrupted"),
    ({"taints": [taint("karpenter.sh/disrupted", effect="NoExecute")]}, "karpenter.sh/disrupted"),
    ({"taints": [taint("karpenter.sh/disruption", "disrupting")]}, "karpenter.sh/disruption"),
    ({"taints": [taint(AUTOSCALER, "1767225600")]}, AUTOSCALER),
    ({"taints": [taint("cloud.google.com/impending-node-termination", effect="NoExecute")]},
     "cloud.google.com/impending-node-termination"),
    ({"unschedulable": True}, "unschedulable"),
]


@pytest.mark.parametrize("spec, signal", SIGNALS, ids=[f"{s}-{i}" for i, (_, s) in enumerate(SIGNALS)])
async def test_each_signal_is_a_drain_and_clearing_it_withdraws(cluster, run_source, spec, signal):
    await cluster.create_node("n1")
    running = run_source(cluster.source())
    await asyncio.sleep(0.2)
    await cluster.patch_spec("n1", spec)
    notice = await running.wait_for(is_notice)
    assert notice.kind is Kind.DRAIN and notice.deadline is None
    assert notice.source == "k8s.node" and notice.node == "n1"
    if signal == "unschedulable":
        assert notice.detail == {"signal": "unschedulable", "unschedulable": True}
    else:
        assert notice.detail["key"] == signal and notice.detail["effect"] == spec["taints"][0]["effect"]
    if signal == AUTOSCALER:
        assert notice.detail["value"] == "1767225600"  # the autoscaler's unix timestamp, kept as given
    clear = {"unschedulable": None} if signal == "unschedulable" else {"taints": []}
    await cluster.patch_spec("n1", clear)
    gone = await running.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == notice.id and gone.source == "k8s.node"


@pytest.mark.parametrize("spec", [
    {"taints": [taint("karpenter.sh/disruption", "candidate")]},
    {"taints": [taint("node.kubernetes.io/not-ready", effect="NoExecute")]},
    {"unschedulable": False},
    {"taints": "not-a-list"},
    {"taints": [{"effect": "NoSchedule"}, 7, None]},
], ids=["karpenter-not-disrupting", "unrelated-taint", "schedulable", "bad-taints", "bad-taint-items"])
def test_other_marks_are_not_signals(spec):
    assert drain_signals({"metadata": {"name": "n1"}, "spec": spec}) == {}


def test_drain_signals_tolerates_missing_or_odd_objects():
    assert drain_signals(None) == {}
    assert drain_signals({"metadata": {"name": "n1"}}) == {}
    assert drain_signals({"spec": []}) == {}


async def test_existing_signals_seen_at_start_and_ids_stable(cluster, run_source):
    await cluster.create_node("n1", {"unschedulable": True, "taints": [taint("karpenter.sh/disrupted")]})
    await cluster.create_node("n2", {"unschedulable": True})
    first = run_source(cluster.source("n1"))
    second = run_source(cluster.source("n1"))
    other = run_source(cluster.source("n2"))
    for running in (first, second, other):
        await running.wait_for(is_notice)
    await asyncio.sleep(0.2)
    ids_first = sorted(u.id for u in first.updates)
    assert len(ids_first) == 2
    assert ids_first == sorted(u.id for u in second.updates)  # stable from (node, signal)
    [other_notice] = other.updates
    assert other_notice.node == "n2" and other_notice.id not in ids_first


async def test_watches_only_its_node_and_sends_the_field_selector(cluster, run_source):
    await cluster.create_node("n1")
    await cluster.create_node("n2")
    running = run_source(cluster.source("n1"))
    await asyncio.sleep(0.3)
    # kmock ignores field selectors, so n2's events reach the client: it must drop them itself.
    await cluster.patch_spec("n2", {"unschedulable": True, "taints": [taint(AUTOSCALER, "1")]})
    await asyncio.sleep(0.3)
    assert running.updates == []
    await cluster.patch_spec("n1", {"taints": [taint(AUTOSCALER, "2")]})
    notice = await running.wait_for(is_notice)
    assert notice.node == "n1" and notice.detail["value"] == "2"
    await asyncio.sleep(0.1)
    assert len(running.updates) == 1
    lists = list(cluster.km[kmock.action.LIST, NODES])
    watches = list(cluster.km[kmock.action.WATCH, NODES])
    assert lists and watches
    for request in lists + watches:
        assert request.params.get("fieldSelector") == "metadata.name=n1"


async def test_a_changed_taint_value_updates_the_same_notice(cluster, run_source):
    await cluster.create_node("n1", {"taints": [taint(AUTOSCALER, "100")]})
    running = run_source(cluster.source())
    first = await running.wait_for(is_notice)
    mark = len(running.updates)
    await cluster.patch_spec("n1", {"taints": [taint(AUTOSCALER, "200")]})
    changed = await running.wait_for(is_notice, after=mark)
    assert changed.id == first.id and changed.detail["value"] == "200"
    assert changed.detected_at == first.detected_at  # the same event, still live


async def test_node_created_late_and_deleted(cluster, run_source):
    running = run_source(cluster.source())
    await asyncio.sleep(0.3)
    assert running.updates == []  # no such Node yet: nothing to report, no error
    await cluster.create_node("n1", {"unschedulable": True})
    notice = await running.wait_for(is_notice)
    await cluster.delete_node("n1")
    gone = await running.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == notice.id
    assert not running.source.stats.errors


async def test_relists_and_rewatches_after_410(cluster, run_source):
    expired = {"type": "ERROR", "object": {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                           "code": 410, "reason": "Expired", "message": "too old resource version"}}
    cluster.km[kmock.action.WATCH, NODES][:1] << (expired,)
    await cluster.create_node("n1")
    source = cluster.source()
    running = run_source(source)
    await cluster.patch_spec("n1", {"taints": [taint("karpenter.sh/disrupted")]})
    notice = await running.wait_for(is_notice)
    assert notice.detail["key"] == "karpenter.sh/disrupted"
    deadline = asyncio.get_running_loop().time() + 5
    while len(list(cluster.km[kmock.action.WATCH, NODES])) < 2:
        assert asyncio.get_running_loop().time() < deadline, "no second watch after the 410"
        await asyncio.sleep(0.02)
    assert source.lists >= 2  # the 410 made it list again before watching again
    assert not source.stats.errors  # an expired watch is routine, not an error
    await cluster.patch_spec("n1", {"taints": []})
    assert (await running.wait_for(lambda u: isinstance(u, Withdrawal))).notice_id == notice.id


@pytest.mark.parametrize("action", [kmock.action.LIST, kmock.action.WATCH])
async def test_api_errors_are_counted_and_recovered_from(cluster, run_source, action):
    await cluster.create_node("n1", {"unschedulable": True})
    cluster.km[action, NODES][:2] << 503 << {"apiVersion": "v1", "kind": "Status", "code": 503,
                                              "message": "apiserver is shutting down"}
    source = cluster.source()
    running = run_source(source)
    notice = await running.wait_for(is_notice)
    deadline = asyncio.get_running_loop().time() + 5
    while source.stats.errors["http_5xx"] < 2:
        assert asyncio.get_running_loop().time() < deadline, source.stats.errors
        assert not running.task.done()
        await asyncio.sleep(0.02)
    await cluster.patch_spec("n1", {"unschedulable": None})
    gone = await running.wait_for(lambda u: isinstance(u, Withdrawal))
    assert gone.notice_id == notice.id
    assert [u for u in running.updates if isinstance(u, Withdrawal)] == [gone]  # errors never withdraw
    assert set(source.stats.errors) == {"http_5xx"}


async def test_unreachable_api_is_counted_and_the_loop_lives(run_source):
    api_client = load_api_client(host="http://127.0.0.1:1")
    try:
        source = NodeSource(api_client, "n1", request_timeout=1.0, backoff=Backoff(base=0.05, cap=0.1))
        running = run_source(source)
        deadline = asyncio.get_running_loop().time() + 10
        while source.stats.errors["connect"] < 2:
            assert asyncio.get_running_loop().time() < deadline, source.stats.errors
            await asyncio.sleep(0.05)
        assert running.updates == [] and not running.task.done()
    finally:
        await asyncio.to_thread(api_client.close)


async def test_never_blocks_the_event_loop(cluster, run_source):
    async def slow_list():
        await asyncio.sleep(0.6)  # returns nothing: kmock then serves the list as usual

    cluster.km[kmock.action.LIST, NODES] << slow_list
    await cluster.create_node("n1", {"unschedulable": True})
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    try:
        running = run_source(cluster.source())
        await running.wait_for(is_notice)  # kmock serves from this very loop: a blocked loop never gets here
        assert ticks >= 10  # the loop kept turning during the 0.6 s list
    finally:
        tick_task.cancel()
        await asyncio.gather(tick_task, return_exceptions=True)


async def test_cancel_stops_the_watcher_thread(cluster, run_source):
    await cluster.create_node("n-stop", {"unschedulable": True})
    running = run_source(cluster.source("n-stop"))
    await running.wait_for(is_notice)
    assert len(watcher_threads("n-stop")) == 1
    running.task.cancel()
    await asyncio.wait_for(asyncio.gather(running.task, return_exceptions=True), 5)
    assert watcher_threads("n-stop") == []  # close() (run's finally) joined it


async def test_close_before_and_after_use(cluster):
    await cluster.create_node("n-close", {"taints": [taint("karpenter.sh/disrupted")]})
    source = cluster.source("n-close")
    await source.close()  # never started: nothing to stop
    [notice] = await asyncio.wait_for(source.poll(), 5)
    assert notice.detail["key"] == "karpenter.sh/disrupted"
    await asyncio.wait_for(source.close(), 5)
    assert watcher_threads("n-close") == []


async def test_malformed_list_is_counted_and_recovered_from(cluster, run_source):
    cluster.km[kmock.action.LIST, NODES][:1] << b"{not json"
    cluster.km[kmock.action.LIST, NODES][1:2] << {"kind": "NodeList", "metadata": {}}  # no items array
    await cluster.create_node("n1", {"unschedulable": True})
    source = cluster.source()
    running = run_source(source)
    notice = await running.wait_for(is_notice)
    assert notice.detail["signal"] == "unschedulable"
    assert source.stats.errors == {"malformed": 2}
    assert source.lists == 3


def test_a_cordon_made_by_the_agent_is_not_a_new_drain_signal():
    from spotguard.agent.sources.k8s_node import drain_signals

    ours = {"metadata": {"name": "n1", "annotations": {"spotguard.io/cordoned": "true"}},
            "spec": {"unschedulable": True}}
    theirs = {"metadata": {"name": "n1", "annotations": {}}, "spec": {"unschedulable": True}}
    assert drain_signals(ours) == {}
    assert "unschedulable" in drain_signals(theirs)


# -- the instance in the ids: the Node object's uid ------------------------------------------------

async def test_a_node_recreated_under_its_name_gives_new_ids(cluster, run_source):
    """A new VM registers a new Node object of the same name (a new uid): the same signal on it
    is a new notice; the same Node keeps its ids across restarted sources."""
    await cluster.create_node("n1", {"unschedulable": True})
    first = run_source(cluster.source())
    before = await first.wait_for(is_notice)
    restarted = run_source(cluster.source())
    assert (await restarted.wait_for(is_notice)).id == before.id
    await restarted.stop()
    await cluster.delete_node("n1")
    assert (await first.wait_for(lambda u: isinstance(u, Withdrawal))).notice_id == before.id
    await cluster.create_node("n1", {"unschedulable": True})
    after = await first.wait_for(is_notice, after=2)
    assert after.id != before.id and after.detail == before.detail
    assert not first.source.stats.errors


async def test_a_node_without_uid_still_yields_its_notices(cluster, run_source):
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {"unschedulable": True}}
    await asyncio.to_thread(cluster.api.create_node, body)  # kmock keeps what it is given: no uid
    running = run_source(cluster.source())
    notice = await running.wait_for(is_notice)
    assert notice.detail == {"signal": "unschedulable", "unschedulable": True}
    assert set(running.source.stats.errors) == {"instance_id:missing"}
    await cluster.create_node("n2", {"unschedulable": True})
    other = run_source(cluster.source("n2"))
    assert (await other.wait_for(is_notice)).id != notice.id  # the fallback still names the node


@pytest.mark.k8s
async def test_the_api_server_gives_a_recreated_node_a_new_identity(control_plane, k8s_namespace, run_source):
    """On a real API server (which sets every Node's uid): delete and re-create a cordoned Node."""
    core = client.CoreV1Api(control_plane.api_client())
    name = f"{k8s_namespace}-n"
    body = {"metadata": {"name": name}, "spec": {"unschedulable": True}}
    await asyncio.to_thread(core.create_node, body)
    try:
        running = run_source(NodeSource(control_plane.api_client(), name, backoff=Backoff(base=0.05, cap=0.2)))
        before = await running.wait_for(is_notice, timeout=20)
        await asyncio.to_thread(core.delete_node, name)
        await running.wait_for(lambda u: isinstance(u, Withdrawal), timeout=20)
        await asyncio.to_thread(core.create_node, body)
        after = await running.wait_for(is_notice, timeout=20, after=2)
        assert after.id != before.id and after.detail == before.detail
        assert not running.source.stats.errors
    finally:
        try:
            await asyncio.to_thread(core.delete_node, name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
