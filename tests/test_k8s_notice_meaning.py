"""What each meaning of a notice (spotguard.wire.notice_policy) does to the jobs, on a real
kube-apiserver (real Job controller and scheduler, no kubelet: phases and IPs are written through
`pods/status`), with the agent's own marker (as spotguard-agent) marking the Node and the
supervisor as its own ServiceAccount: three Indexed Jobs of 3 replicas, one per node (elastic,
elastic in place, fixed).

- a maintenance beyond the horizon changes no job, no record and no membership until
  deadline - horizon, then acts as any departure (elastic scales to the survivors, in place the
  membership drops the node, fixed waits for the checkpoint);
- canceled before that, it never did anything: every job stays whole;
- canceled after it came due, before any replica drained: the fixed job's checkpoint wait ends
  (back to Running, Event SpotguardNoticeWithdrawn) and nothing is suspended at the stale deadline;
- a rebalance recommendation changes no membership, and its replicas stay members and survivors
  when another node departs.
Every change of the jobs (spec, record, steps lost) and of the pods' memberships is watched as
it arrives, with its arrival time."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
import pytest

from spotguard.agent.node_marker import NodeMarker
from spotguard.kube.api import JOBS, PODS, Kube
from spotguard.supervisor.informer import Informer
from spotguard.supervisor.record import Record
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice
from spotguard.wire.notice_policy import HORIZON_SECONDS
from tests.k8s_world import add_ready_node, refusals, set_pod_running, wait_until
from tests.test_k8s_supervisor import POOL, _controller
from tests.test_node_marker import make_notice

pytestmark = pytest.mark.k8s
PORT = "31000"
ELASTIC, IN_PLACE, FIXED = "elastic", "in-place", "fixed"
FAR_SIGHTED = "far-sighted"  # elastic, its Guard's horizon set longer in its template
ANNOTATIONS = {
    ELASTIC: {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"},
    FAR_SIGHTED: {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"},
    IN_PLACE: {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1", names.ANN_IN_PLACE: "true"},
    FIXED: {names.ANN_POLICY: "fixed"},
}
# A maintenance whose release (deadline - horizon) comes this long after it is announced: a premature
# action comes within the supervisor's reaction (~1 s), and the cancel case's mark and withdrawal,
# seen, take ~1 s (each test checks that they came before the release).
HELD_FOR = 10.0
DUE_IN = 15.0  # a maintenance within the horizon, due at once: its deadline this far off
FAR_HORIZON = HORIZON_SECONDS + 600.0


def _job(name: str, pool: str) -> dict:
    """3 replicas of one GPU, one per node (pod anti-affinity), on the test's nodes."""
    spread = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"job-name": name}}, "topologyKey": "kubernetes.io/hostname"}]}}
    container = {"name": "train", "image": "train:1", "env": [{"name": names.ENV_RDZV_PORT, "value": PORT}],
                 "resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}}
    if name == FAR_SIGHTED:
        container["env"].append({"name": names.ENV_HORIZON_SECONDS, "value": f"{FAR_HORIZON:g}"})
    template = {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "nodeSelector": {POOL: pool},
                         "affinity": spread, "containers": [container]}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {names.LABEL_MANAGED: "true"}, "annotations": ANNOTATIONS[name]},
            "spec": {"parallelism": 3, "completions": 3, "completionMode": "Indexed", "backoffLimit": 10,
                     "podFailurePolicy": {"rules": [{"action": "Ignore", "onExitCodes": {
                         "containerName": "train", "operator": "In", "values": [names.EXIT_PREEMPTED]}}]},
                     "template": template}}


class World:
    """3 nodes of 3 GPUs and the test's jobs, each with one Running pod (with an IP) per node.
    Blocking helpers: run them in threads."""

    def __init__(self, plane, ns: str, jobs: tuple[str, ...]):
        self.plane, self.ns, self.jobs = plane, ns, jobs
        self.core = kubernetes.client.CoreV1Api(plane.api_client())
        self.batch = kubernetes.client.BatchV1Api(plane.api_client())
        self.nodes = [add_ready_node(plane, f"{ns}-n{i}", labels={POOL: ns}, gpus=3) for i in range(3)]
        for job in jobs:
            self.batch.create_namespaced_job(ns, _job(job, ns))
        for j, job in enumerate(jobs):
            pods = wait_until(lambda job=job: self._bound(job), 60, f"the 3 pods of {job} bound")
            for pod in pods:
                index = int(pod.metadata.annotations["batch.kubernetes.io/job-completion-index"])
                set_pod_running(plane, ns, pod.metadata.name, f"10.{j}.0.{index + 1}")

    def _bound(self, job: str) -> list | None:
        pods = self.pods(job)
        return pods if len(pods) == 3 and all(p.spec.node_name for p in pods) else None

    def pods(self, job: str) -> list:
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=f"job-name={job}").items
                if not p.metadata.deletion_timestamp and p.status.phase not in ("Succeeded", "Failed")]

    def job(self, name: str) -> dict:
        return self.batch.read_namespaced_job(name, self.ns).to_dict()

    def record(self, name: str) -> dict:
        text = (self.job(name)["metadata"]["annotations"] or {}).get(names.ANN_STATUS)
        return json.loads(text) if text else {}

    def membership(self, pod) -> dict | None:
        text = (pod.metadata.annotations or {}).get(names.ANN_MEMBERSHIP)
        return json.loads(text) if text else None

    def told(self, job: str, hosts: list[str]) -> dict | None:
        """The membership every Running pod of `job` on `hosts` was told, once it lists exactly
        them, in their pods' completion-index order (the first membership's order)."""
        pods = sorted((p for p in self.pods(job) if p.spec.node_name in hosts and p.status.phase == "Running"),
                      key=lambda p: int(p.metadata.annotations["batch.kubernetes.io/job-completion-index"]))
        ordered = [p.spec.node_name for p in pods]
        values = [self.membership(p) for p in pods]
        ok = len(pods) == len(hosts) and all(v is not None and v["hosts"] == ordered for v in values)
        return values[0] if ok else None

    def events(self, job: str, reason: str) -> list:
        return [e for e in self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={job}").items
                if e.reason == reason]

    def cleanup(self) -> None:
        for node in self.nodes:
            self.core.delete_node(node)


@dataclass(frozen=True)
class Change:
    at: datetime  # when the watch delivered it (the write came before)
    name: str  # "job <name>" or "pod <name>"
    before: tuple
    after: tuple


SYNC = "spotguard-test/sync"
NO_DECISION = {k: v for k, v in json.loads(Record().to_json()).items() if k != "cost"}  # a record of the cost only


class Changes:
    """Every change of the jobs' spec / record / steps lost and of the pods' membership, as the
    watch delivers it, after a first full list. `sync()` returns once every write made before it
    was delivered (a test annotation written last, seen on both watches: a watch is ordered)."""

    def __init__(self, plane, ns: str):
        self.kube = Kube(plane.api_client())
        self.ns = ns
        self.seen: dict[str, tuple] = {}
        self.log: list[Change] = []
        self.informers: list[Informer] = []
        self.synced: set[tuple[str, str]] = set()

    async def start(self) -> Changes:
        loop = asyncio.get_running_loop()
        self.informers = [Informer(self.kube, JOBS, self.ns, lambda k, p: self._on(k, p, self._job_facts), loop),
                          Informer(self.kube, PODS, self.ns, lambda k, p: self._on(k, p, self._pod_facts), loop)]
        for informer in self.informers:
            informer.start()
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self.informers)), 30)
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(i.stop) for i in self.informers))
        self.kube.api_client.close()

    async def sync(self, job: str, pod: str) -> None:
        mark = str(len(self.synced))
        for res, name in ((JOBS, job), (PODS, pod)):
            await asyncio.to_thread(self.kube.patch, res, self.ns, name, {"metadata": {"annotations": {SYNC: mark}}})
        await asyncio.to_thread(wait_until, lambda: {("job", mark), ("pod", mark)} <= self.synced, 30,
                                "the watches caught up")

    @staticmethod
    def _job_facts(obj: dict) -> tuple[str, tuple]:
        """The job's spec and decision record; the cost totals, which the supervisor saves into
        the record every `cost_save_interval` whatever happens, are no decision and left out."""
        annotations = obj["metadata"].get("annotations") or {}
        spec = obj.get("spec") or {}
        record = {k: v for k, v in json.loads(annotations.get(names.ANN_STATUS) or "{}").items() if k != "cost"}
        decided = json.dumps(record, sort_keys=True) if record and record != NO_DECISION else None
        return f"job {obj['metadata']['name']}", (spec.get("parallelism"), spec.get("suspend"), decided,
                                                  annotations.get(names.ANN_STEPS_LOST))

    @staticmethod
    def _pod_facts(obj: dict) -> tuple[str, tuple]:
        annotations = obj["metadata"].get("annotations") or {}
        return f"pod {obj['metadata']['name']}", (annotations.get(names.ANN_MEMBERSHIP),)

    def _on(self, kind: str, payload: Any, facts) -> None:
        if kind == "DELETED":
            return  # a pod the Job controller deletes follows a job change, which is logged
        for obj in payload if kind == "SYNC" else [payload]:
            name, value = facts(obj)
            if SYNC in (obj["metadata"].get("annotations") or {}):
                self.synced.add((name.split()[0], obj["metadata"]["annotations"][SYNC]))
            if kind != "SYNC" and self.seen.get(name, (None,) * len(value)) != value:
                self.log.append(Change(datetime.now(UTC), name, self.seen.get(name, ()), value))
            self.seen[name] = value

    def before(self, when: datetime) -> list[str]:
        """The changes delivered before `when`, as text."""
        return [f"{c.at.isoformat()} {c.name}: {c.before} -> {c.after}" for c in self.log if c.at < when]


class Agent:
    """The node agent's marker on one Node, as spotguard-agent."""

    def __init__(self, plane, node: str):
        self.node = node
        self.marker = NodeMarker(plane.client_as("spotguard-agent"), node, event_pods=False)

    async def mark(self, *notices: Notice) -> None:
        self.marker.notify(list(notices))
        await asyncio.to_thread(wait_until, lambda: self.marker.in_sync, 20, f"{self.node} marked")


@dataclass
class Run:
    world: World
    controller: Any
    changes: Changes
    agents: dict[str, Agent]

    def seen_by_supervisor(self, node: str, marked: bool) -> bool:
        cached = (self.controller.cache.nodes.get(node) or {}).get("metadata", {}).get("annotations") or {}
        return (names.ANN_NOTICE in cached) is marked

    async def passes(self) -> None:
        """One more pass over every job; returns once what it changed was delivered to `changes`."""
        for job in self.world.jobs:
            await self.controller.reconciler.reconcile(("Job", self.world.ns, job))
        job = self.world.jobs[0]
        pod = (await asyncio.to_thread(self.world.pods, job))[0].metadata.name
        await self.changes.sync(job, pod)


async def _run(plane, ns: str, jobs: tuple[str, ...] = (ELASTIC, IN_PLACE, FIXED)):
    world = await asyncio.to_thread(World, plane, ns, jobs)
    controller = _controller(plane, ns)
    await controller.start()
    changes = await Changes(plane, ns).start()
    agents = {node: Agent(plane, node) for node in world.nodes}
    for agent in agents.values():
        await agent.marker.start()
    return Run(world, controller, changes, agents)


async def _end(run: Run) -> None:
    for agent in run.agents.values():
        await agent.marker.stop()
    await run.changes.stop()
    await run.controller.stop()
    await asyncio.to_thread(run.world.cleanup)


def _release(notice: Notice) -> datetime:
    assert notice.deadline is not None
    return notice.deadline - timedelta(seconds=HORIZON_SECONDS)


async def test_a_maintenance_beyond_the_horizon_changes_nothing_until_its_release_then_acts(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    run = await _run(control_plane, k8s_namespace)
    world = run.world
    try:
        n0, survivors = world.nodes[0], world.nodes[1:]
        notice = make_notice(Kind.MAINTENANCE, HORIZON_SECONDS + HELD_FOR, "m", node=n0)
        await run.agents[n0].mark(notice)

        await asyncio.to_thread(wait_until, lambda: world.record(FIXED).get("phase") == "Checkpointing", 60,
                                "the fixed job's checkpoint wait, after the release")
        await asyncio.to_thread(wait_until, lambda: world.job(ELASTIC)["spec"]["parallelism"] == 2, 60,
                                "the elastic job scaled to its 2 survivors")
        in_place = await asyncio.to_thread(wait_until, lambda: world.told(IN_PLACE, survivors), 60,
                                           "the in-place membership without the departing node")
        assert in_place["world_size"] == 2
        release = _release(notice)
        assert run.changes.before(release) == []  # nothing at all before deadline - horizon
        for job in world.jobs:
            record = await asyncio.to_thread(world.record, job)
            decided = datetime.fromisoformat(record["decided_at"].replace("Z", "+00:00"))
            assert decided >= release, (job, record)
        fixed = await asyncio.to_thread(world.record, FIXED)
        assert fixed["checkpoint_deadline"] and fixed["awaiting"] == {notice.id: n0}
        assert not (await asyncio.to_thread(world.job, FIXED))["spec"]["suspend"]
    finally:
        await _end(run)
    assert not refusals(caplog)


async def test_each_job_holds_a_notice_for_the_horizon_its_guard_has(control_plane, k8s_namespace, caplog):
    """Two elastic jobs on the same nodes; one's template sets SPOTGUARD_HORIZON_SECONDS longer
    (as its Guard and its sidecar read it). A maintenance due beyond the default horizon, within
    the longer one, is a departure at once for that job (it scales to its survivors) and held
    for the other until its release."""
    caplog.set_level(logging.INFO)
    run = await _run(control_plane, k8s_namespace, (ELASTIC, FAR_SIGHTED))
    world = run.world
    try:
        n0 = world.nodes[0]
        notice = make_notice(Kind.MAINTENANCE, HORIZON_SECONDS + HELD_FOR, "m", node=n0)
        await run.agents[n0].mark(notice)
        await asyncio.to_thread(wait_until, lambda: world.job(FAR_SIGHTED)["spec"]["parallelism"] == 2, 60,
                                "the far-sighted job scaled to its 2 survivors")
        release = _release(notice)
        assert datetime.now(UTC) < release, "too slow here: the far-sighted job acted after the default release"
        await run.passes()
        assert all(FAR_SIGHTED in change for change in run.changes.before(release)), run.changes.before(release)
        await asyncio.to_thread(wait_until, lambda: world.job(ELASTIC)["spec"]["parallelism"] == 2, 60,
                                "the other job scaled, after the release")
        record = await asyncio.to_thread(world.record, ELASTIC)
        assert datetime.fromisoformat(record["decided_at"].replace("Z", "+00:00")) >= release, record
    finally:
        await _end(run)
    assert not refusals(caplog)


async def test_a_maintenance_canceled_before_its_release_never_did_anything(control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    run = await _run(control_plane, k8s_namespace)
    world = run.world
    try:
        n0 = world.nodes[0]
        notice = make_notice(Kind.MAINTENANCE, HORIZON_SECONDS + HELD_FOR, "m", node=n0)
        await run.agents[n0].mark(notice)
        await asyncio.to_thread(wait_until, lambda: run.seen_by_supervisor(n0, True), 30, "the mark seen")
        await run.agents[n0].mark()  # the cloud canceled it: the agent withdraws the mark
        await asyncio.to_thread(wait_until, lambda: run.seen_by_supervisor(n0, False), 30, "the withdrawal seen")
        assert datetime.now(UTC) < _release(notice), "too slow here: canceled after its release, not before"
        await asyncio.to_thread(wait_until, lambda: datetime.now(UTC) > _release(notice) + timedelta(seconds=1), 60,
                                "the release time passed")
        await run.passes()
        assert run.changes.before(datetime.max.replace(tzinfo=UTC)) == []
        for job in world.jobs:
            obj = await asyncio.to_thread(world.job, job)
            assert (obj["spec"]["parallelism"], bool(obj["spec"]["suspend"])) == (3, False), job
            record = await asyncio.to_thread(world.record, job)  # at most the cost totals, no decision
            assert not record.get("decided_at") and not record.get("handled") and not record.get("members"), job
            pods = await asyncio.to_thread(world.pods, job)
            assert len(pods) == 3 and not [p for p in pods if world.membership(p)], job
    finally:
        await _end(run)
    assert not refusals(caplog)


async def test_a_maintenance_withdrawn_during_the_checkpoint_wait_suspends_nothing(
        control_plane, k8s_namespace, caplog):
    """The issue's second case: a maintenance canceled after it came due, before any replica
    drained. Before, the supervisor suspended the fixed job at the stale deadline and its
    training restarted for a maintenance canceled long before."""
    caplog.set_level(logging.INFO)
    run = await _run(control_plane, k8s_namespace, (FIXED,))
    world = run.world
    try:
        n0 = world.nodes[0]
        notice = make_notice(Kind.MAINTENANCE, DUE_IN, "m", node=n0)  # within the horizon: due at once
        await run.agents[n0].mark(notice)
        await asyncio.to_thread(wait_until, lambda: world.record(FIXED).get("phase") == "Checkpointing", 30,
                                "the checkpoint wait")
        await run.agents[n0].mark()  # withdrawn
        await asyncio.to_thread(wait_until, lambda: world.record(FIXED).get("reason") == "NoticeWithdrawn", 30,
                                "the wait ended")
        record = await asyncio.to_thread(world.record, FIXED)
        assert record["phase"] == "Running" and notice.id not in record["handled"]
        await asyncio.to_thread(wait_until, lambda: world.events(FIXED, names.EVENT_NOTICE_WITHDRAWN), 30, "the Event")
        assert notice.deadline is not None
        assert datetime.now(UTC) < notice.deadline, "too slow here: withdrawn after the deadline, not during the wait"
        await asyncio.to_thread(wait_until, lambda: datetime.now(UTC) > notice.deadline + timedelta(seconds=1), 60,
                                "the stale deadline passed")
        await run.passes()
        obj = await asyncio.to_thread(world.job, FIXED)
        assert not obj["spec"]["suspend"] and (await asyncio.to_thread(world.record, FIXED))["phase"] == "Running"
        assert not [c for c in run.changes.log if c.name == f"job {FIXED}" and c.after[1]]  # never suspended
        assert not await asyncio.to_thread(world.events, FIXED, names.EVENT_SUSPENDED)
        assert len(await asyncio.to_thread(world.pods, FIXED)) == 3
    finally:
        await _end(run)
    assert not refusals(caplog)


async def test_a_rebalance_changes_no_membership_and_its_replicas_stay_survivors(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    run = await _run(control_plane, k8s_namespace)
    world = run.world
    try:
        n0, n1, n2 = world.nodes
        await run.agents[n0].mark(make_notice(Kind.REBALANCE, None, "r", node=n0))
        await asyncio.to_thread(wait_until, lambda: run.seen_by_supervisor(n0, True), 30, "the rebalance seen")
        await run.passes()
        assert run.changes.before(datetime.max.replace(tzinfo=UTC)) == []  # no membership, no record, no scale

        await run.agents[n1].mark(make_notice(Kind.RECLAIM, 120.0, "r", node=n1))  # another node departs
        in_place = await asyncio.to_thread(wait_until, lambda: world.told(IN_PLACE, [n0, n2]), 60,
                                           "the in-place membership keeps the rebalance's node")
        assert in_place["world_size"] == 2
        fixed = await asyncio.to_thread(wait_until, lambda: world.record(FIXED).get("awaiting"), 60,
                                        "the fixed job's checkpoint wait")
        assert list(fixed.values()) == [n1]  # for the departure only
        await asyncio.to_thread(wait_until, lambda: world.job(ELASTIC)["spec"]["parallelism"] == 2, 60,
                                "the elastic job scaled to its 2 survivors, the rebalance's replica among them")

        def elastic_told():
            # The Job controller picks the pod a scale-in removes (here n1's, or a survivor's): the
            # members are the Running pods off n1, the rebalance's node among them while its pod runs.
            left = {p.spec.node_name for p in world.pods(ELASTIC) if p.spec.node_name != n1
                    and p.status.phase == "Running"}
            return left and world.told(ELASTIC, sorted(left))
        await asyncio.to_thread(wait_until, elastic_told, 60, "the elastic membership of the pods off n1")
    finally:
        await _end(run)
    assert not refusals(caplog)
