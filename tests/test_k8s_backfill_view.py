"""The operator's view of a backfill job on a real kube-apiserver (real Job controller and
scheduler, no kubelet), with the supervisor as its own ServiceAccount: what `spotguard status`
(the real command), the Events, the job's conditions and the metrics say at each point of a
backfill job's life, and how fast a scheduler preemption gets its replacement.

The job is tests/test_k8s_backfill_spare.py's: in place, start at min (1), max 2, the fallback to
on-demand, and the spare (parallelism 3). Spot nodes s0, s1 and on-demand o0, o1, one GPU each.
1. Start: both spot slots placed at once, nothing runs yet: `Starting`, 0 replicas (never the
   Job's parallelism, which counts the spare), the placement as the last decision, with its Event.
2. The pods run: `Running` at the group's size, its membership in the detail.
3. A reclaim with no spot free: the spare is the on-demand warm standby (its Event names the pod
   and why); once it runs, `spotguard_job_on_demand` is 1 (the on-demand alert reads it), and
   `SpotguardSuspended=False` does not carry the notice's message.
4. Spot back: after return-after the spare goes to spot (SwappingToSpot Event), takes the
   on-demand member's place, and the gauge goes back to 0.
5. A scheduler preemption of a member (a higher-priority pod pinned to its node; grace period 0:
   the scheduler sets DisruptionTarget and the pod is gone at once): its replacement, the spare,
   is placed on on-demand at once, long before fallback-after (60 s; it waited for it before).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import kubernetes
import pytest

from spotguard.kube.api import Kube
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.policy import Settings
from spotguard.wire import names
from tests.k8s_world import add_ready_node, refusals, set_container_exit, wait_until
from tests.test_k8s_backfill import CAPACITY, POOL
from tests.test_k8s_backfill_spare import FALLBACK_AFTER, MAX, RETURN_AFTER, SparePods, _job
from tests.test_k8s_preemption import priority_class  # noqa: F401  (a fixture)
from tests.test_k8s_status import status
from tests.test_k8s_supervisor import _mark

pytestmark = pytest.mark.k8s


class View:
    """What an operator sees of the job `train`: the real `spotguard status` (table, JSON and
    detail), the job's Events and conditions, and the supervisor's metrics (blocking calls)."""

    def __init__(self, plane, ns: str, controller: Controller):
        self.plane, self.ns, self.controller = plane, ns, controller
        self.core = kubernetes.client.CoreV1Api(plane.api_client())
        self.batch = kubernetes.client.BatchV1Api(plane.api_client())
        self.kubeconfig = str(plane.kubeconfig())

    def row(self) -> dict:
        result = status("train", "-n", self.ns, "--kubeconfig", self.kubeconfig, "-o", "json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["items"][0]

    def table(self) -> list[str]:
        result = status("-n", self.ns, "--kubeconfig", self.kubeconfig)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()[1].split()

    def detail(self) -> str:
        result = status("train", "-n", self.ns, "--kubeconfig", self.kubeconfig)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def events(self, reason: str) -> list:
        return [e for e in self.core.list_namespaced_event(
            self.ns, field_selector="involvedObject.kind=Job,involvedObject.name=train").items if e.reason == reason]

    def condition(self, kind: str) -> dict | None:
        job = self.batch.read_namespaced_job("train", self.ns)
        return next(({"status": c.status, "reason": c.reason, "message": c.message}
                     for c in job.status.conditions or [] if c.type == kind), None)

    def on_demand_gauge(self) -> float:
        found = re.search(r'^spotguard_job_on_demand\{[^}]*job="train"[^}]*\} (\S+)$',
                          self.controller.metrics.render(), re.M)
        assert found, "spotguard_job_on_demand of the job is not exported"
        return float(found.group(1))


async def test_the_operator_view_of_a_backfill_job_and_a_preemption_answered_at_once(
        control_plane, k8s_namespace, priority_class, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    ns = pool = k8s_namespace
    spot = [add_ready_node(control_plane, f"{pool}-s{i}", {CAPACITY: "spot", POOL: pool}) for i in (0, 1)]
    on_demand = {add_ready_node(control_plane, f"{pool}-o{i}", {CAPACITY: "on-demand", POOL: pool}) for i in (0, 1)}
    batch.create_namespaced_job(ns, _job(pool))
    pods = SparePods(control_plane, ns)
    active, gated_spare, bound = pods.active, pods.gated_spare, pods.bound

    def run(pod) -> None:
        pods.run(pod, True)

    def hosts() -> list[str] | None:
        value = pods.membership()
        return value["hosts"] if value else None

    config = ControllerConfig(identity="supervisor-test", namespace=ns, resync=5.0,
                              settings=Settings(checkpoint_timeout=30.0))
    controller = Controller(Kube(control_plane.client_as("spotguard-supervisor")), config)
    view = View(control_plane, ns, controller)
    await controller.start()
    try:
        # 1. Start: placed on spot, nothing runs yet.
        members = await asyncio.to_thread(wait_until, lambda: len(bound(spot)) == MAX and bound(spot), 30,
                                          "2 pods placed on spot")
        row = await asyncio.to_thread(wait_until, lambda: (r := view.row())["backfill_event"] and r, 30,
                                      "the placement in the record")
        assert (row["phase"], row["replicas"], row["max_replicas"]) == ("Starting", 0, MAX), row
        assert (row["last_decision"], row["last_reason"]) == (names.EVENT_PLACED_ON_SPOT, "Backfill")
        assert row["backfill_at"] and row["generation"] is None
        cells = await asyncio.to_thread(view.table)
        assert cells[4:6] == ["Starting", f"0/1/{MAX}"] and cells[-2] == "PlacedOnSpot", cells
        placed = await asyncio.to_thread(wait_until, lambda: view.events(names.EVENT_PLACED_ON_SPOT), 30,
                                         "the placement's Event")
        assert "2 spot replica(s) for free spot slots" in placed[0].message

        # 2. The pods run: the group forms.
        for pod in members:
            await asyncio.to_thread(run, pod)
        await asyncio.to_thread(wait_until, lambda: set(hosts() or ()) == set(spot), 30, "the first group")
        spare = await asyncio.to_thread(wait_until, gated_spare, 30, "the spare, gated")
        row = await asyncio.to_thread(wait_until, lambda: (r := view.row())["generation"] and r, 30,
                                      "the membership in the record")
        assert (row["phase"], row["replicas"], sorted(row["members"])) == ("Running", MAX, sorted(spot)), row
        assert (await asyncio.to_thread(view.table))[4:6] == ["Running", f"{MAX}/1/{MAX}"]
        assert await asyncio.to_thread(view.on_demand_gauge) == 0

        # 3. A reclaim on s0, no spot free: the spare is the on-demand warm standby.
        await _mark(control_plane, spot[0])
        standby = (await asyncio.to_thread(wait_until, lambda: bound(on_demand), 30, "the warm standby placed"))[0]
        assert standby.metadata.name == spare.metadata.name
        events = await asyncio.to_thread(wait_until, lambda: view.events(names.EVENT_WARM_STANDBY), 30,
                                         "the warm standby's Event")
        assert f"{standby.metadata.name} on on-demand" in events[0].message and "no spot slot free" in events[0].message
        row = await asyncio.to_thread(view.row)
        assert row["replicas"] == MAX and row["backfill_event"] == names.EVENT_WARM_STANDBY  # the member is held
        await asyncio.to_thread(run, standby)
        await asyncio.to_thread(wait_until, lambda: set(hosts() or ()) == {spot[1], standby.spec.node_name}, 30,
                                "the standby in the group")
        assert await asyncio.to_thread(view.on_demand_gauge) == 1  # a replica runs on on-demand
        suspended = await asyncio.to_thread(view.condition, names.COND_SUSPENDED)
        assert suspended == {"status": "False", "reason": "Running",
                             "message": "spotguard does not keep the job suspended"}, suspended
        leaving = next(p for p in members if p.spec.node_name == spot[0])
        await asyncio.to_thread(set_container_exit, control_plane, ns, leaving.metadata.name, names.EXIT_PREEMPTED)
        spare = await asyncio.to_thread(wait_until, gated_spare, 40, "the next spare, gated")

        # 4. Spot back: after return-after, the spare to spot, in the on-demand member's place.
        spot.append(add_ready_node(control_plane, f"{pool}-s2", {CAPACITY: "spot", POOL: pool}))
        joiner = (await asyncio.to_thread(wait_until, lambda: bound({spot[2]}), RETURN_AFTER + 30,
                                          "the spare placed on spot"))[0]
        events = await asyncio.to_thread(wait_until, lambda: view.events(names.EVENT_SWAPPING_TO_SPOT), 30,
                                         "the swap's Event")
        assert f"{joiner.metadata.name} on spot" in events[0].message and "return-after" in events[0].message
        row = await asyncio.to_thread(view.row)
        assert row["last_decision"] == names.EVENT_SWAPPING_TO_SPOT and row["below_max_since"] is None, row
        await asyncio.to_thread(run, joiner)
        await asyncio.to_thread(wait_until, lambda: set(hosts() or ()) == {spot[1], spot[2]}, 30, "the swap")
        await asyncio.to_thread(set_container_exit, control_plane, ns, standby.metadata.name, names.EXIT_PREEMPTED)
        await asyncio.to_thread(wait_until, lambda: view.on_demand_gauge() == 0, 30, "the gauge back at 0")
        text = await asyncio.to_thread(view.detail)
        assert re.search(rf"^Membership:\s+generation \d+: ({spot[1]}, {spot[2]}|{spot[2]}, {spot[1]})$", text, re.M)
        assert re.search(r"^Last placement:\s+SpotguardSwappingToSpot \d+s ago: ", text, re.M), text
        spare = await asyncio.to_thread(wait_until, gated_spare, 60, "the spare after the swap, gated")

        # 5. A scheduler preemption of the member on s1: its replacement at once.
        victim = next(p for p in active() if p.spec.node_name == spot[1])
        serving = {"metadata": {"name": "serving"}, "spec": {
            "priorityClassName": priority_class, "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": spot[1]},
            "containers": [{"name": "serve", "image": "serve:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
        preempted_at = time.monotonic()
        await asyncio.to_thread(core.create_namespaced_pod, ns, serving)
        replacement = (await asyncio.to_thread(wait_until, lambda: bound(on_demand), FALLBACK_AFTER + 30,
                                               "the spare placed for the preempted member"))[0]
        placed_after = time.monotonic() - preempted_at
        print(f"preemption of a backfill member -> its replacement placed {placed_after:.2f}s "
              f"(fallback-after {FALLBACK_AFTER:g}s)")
        assert replacement.metadata.name == spare.metadata.name
        assert placed_after < FALLBACK_AFTER / 4, placed_after
        # The kubelet's part: the victim's ranks drain on SIGTERM (exit 83); the Job controller then
        # drops its tracking finalizer and the pod is gone.
        await asyncio.to_thread(set_container_exit, control_plane, ns, victim.metadata.name, names.EXIT_PREEMPTED)
        await asyncio.to_thread(wait_until, lambda: victim.metadata.name not in {
            p.metadata.name for p in core.list_namespaced_pod(ns).items}, 120, "the victim gone")
        events = await asyncio.to_thread(wait_until, lambda: [e for e in view.events(names.EVENT_WARM_STANDBY)
                                                              if replacement.metadata.name in e.message], 30,
                                         "the replacement's Event")
        assert "warm standby for a" in events[0].message
        await asyncio.to_thread(run, replacement)
        await asyncio.to_thread(wait_until, lambda: set(hosts() or ()) == {spot[2], replacement.spec.node_name}, 30,
                                "the replacement in the group")
        row = await asyncio.to_thread(view.row)
        assert (row["phase"], row["replicas"]) == ("Running", MAX), row
    finally:
        await controller.stop()
    assert not refusals(caplog)
