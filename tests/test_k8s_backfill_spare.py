"""The warm standby and the swap-back on a real kube-apiserver (real Job controller and scheduler,
no kubelet: phases, IPs, readiness and exit codes are written through `pods/status`), with the
supervisor as its own ServiceAccount (RBAC and admission policies of daemonset/base).

An in-place, start-at-min, backfill Indexed Job asks for max + 1 replicas: the extra one is the
spare (supervisor/placement.py). It stays gated while the job is whole. A reclaim notice on a
spot member places it at once (warm standby: on-demand, as no spot slot is free, long before
`fallback-after`); the memberships say `standby`, so the noticed member stays listed (its rank
trains on, the replacement hold) until the standby is Ready, which then takes its place in ONE
membership. When spot capacity has been free for `return-after`,
the spare is placed on spot and, once Ready, takes the on-demand member's place in ONE membership
(same size, one generation). Each member that left exits 83 and the Job controller re-creates its
index gated: the next spare."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import kubernetes
import pytest

from spotguard.kube.api import Kube
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.policy import Settings
from spotguard.wire import names
from tests.k8s_world import add_ready_node, refusals, set_container_exit, set_pod_running, wait_until
from tests.test_k8s_backfill import CAPACITY, POOL
from tests.test_k8s_backfill import _job as backfill_job
from tests.test_k8s_supervisor import _mark

pytestmark = pytest.mark.k8s

PORT = "31000"
MAX = 2
FALLBACK_AFTER = 60.0  # the warm standby must not wait for it
RETURN_AFTER = 2.0


def _job(pool: str) -> dict:
    """test_k8s_backfill's Job with the spare: max + 1 replicas, start at min, the rendezvous port."""
    job = backfill_job(pool)
    job["metadata"]["annotations"].update({
        names.ANN_MIN_REPLICAS: "1", names.ANN_MAX_REPLICAS: str(MAX), names.ANN_START_AT_MIN: "true",
        names.ANN_FALLBACK_AFTER: f"{FALLBACK_AFTER:g}s", names.ANN_RETURN_AFTER: f"{RETURN_AFTER:g}s"})
    job["spec"].update(parallelism=MAX + 1, completions=MAX + 1)
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": names.ENV_RDZV_PORT, "value": PORT}]
    return job


class SparePods:
    """The Job `train`'s pods, read and run as a kubelet would (blocking calls)."""

    def __init__(self, plane, ns: str):
        self.plane, self.ns = plane, ns
        self.core = kubernetes.client.CoreV1Api(plane.api_client())
        self.ips: dict[str, str] = {}

    def active(self) -> list:
        """Not finished and not being deleted."""
        return [p for p in self.core.list_namespaced_pod(
            self.ns, label_selector="batch.kubernetes.io/job-name=train").items
            if p.status.phase not in ("Succeeded", "Failed") and not p.metadata.deletion_timestamp]

    def gated_spare(self):
        """The one gated pod, once the job has all its pods (max + 1); else None."""
        pods = self.active()
        spares = [p for p in pods if p.spec.scheduling_gates and not p.spec.node_name]
        return spares[0] if len(pods) == MAX + 1 and len(spares) == 1 else None

    def bound(self, nodes) -> list:
        return [p for p in self.active() if p.spec.node_name in nodes]

    def run(self, pod, ready: bool) -> None:
        ip = self.ips.setdefault(pod.metadata.name, f"10.244.3.{len(self.ips) + 1}")
        set_pod_running(self.plane, self.ns, pod.metadata.name, ip, ready)

    def membership(self) -> dict | None:
        """The membership every bound pod was told, once they all were told the same one."""
        values = {(p.metadata.annotations or {}).get(names.ANN_MEMBERSHIP) for p in self.active() if p.spec.node_name}
        return json.loads(values.pop()) if len(values) == 1 and None not in values else None


async def test_the_spare_is_the_warm_standby_and_swaps_an_on_demand_member_back_to_spot(
        control_plane, k8s_namespace, caplog):
    caplog.set_level(logging.INFO)
    api = control_plane.api_client()
    batch = kubernetes.client.BatchV1Api(api)
    ns = pool = k8s_namespace
    spot = [add_ready_node(control_plane, f"{pool}-spot-{i}", {CAPACITY: "spot", POOL: pool}) for i in (0, 1)]
    on_demand = {add_ready_node(control_plane, f"{pool}-od-{i}", {CAPACITY: "on-demand", POOL: pool})
                 for i in (0, 1)}
    batch.create_namespaced_job(ns, _job(pool))
    pods = SparePods(control_plane, ns)
    gated_spare, bound, run, membership = pods.gated_spare, pods.bound, pods.run, pods.membership

    def told(hosts: set[str], newer: int = 0):
        value = membership()
        return value if value and set(value["hosts"]) == hosts and value["generation"] > newer else None

    config = ControllerConfig(identity="supervisor-test", namespace=ns, resync=5.0,
                              settings=Settings(checkpoint_timeout=30.0))
    controller = Controller(Kube(control_plane.client_as("spotguard-supervisor")), config)
    await controller.start()
    try:
        # Start: both spot slots taken at once, the third pod stays gated (the spare).
        members = await asyncio.to_thread(wait_until, lambda: len(bound(spot)) == MAX and bound(spot), 30,
                                          "2 pods placed on spot")
        for pod in members:
            await asyncio.to_thread(run, pod, True)
        first = await asyncio.to_thread(wait_until, lambda: told(set(spot)), 30, "the first membership")
        assert first["world_size"] == MAX  # the start group (min 1) and its growth, or both at once
        assert await asyncio.to_thread(wait_until, gated_spare, 30, "the spare, gated")

        # Warm standby: a notice on a spot member places the spare at once, on on-demand.
        leaving = next(p for p in members if p.spec.node_name == spot[0])
        noticed_at = time.monotonic()
        await _mark(control_plane, spot[0])
        standby = (await asyncio.to_thread(wait_until, lambda: bound(on_demand), 30, "the warm standby placed"))[0]
        placed_after = time.monotonic() - noticed_at
        assert placed_after < FALLBACK_AFTER / 2, placed_after
        assert standby.spec.node_selector[CAPACITY] == "on-demand"
        await asyncio.to_thread(run, standby, False)
        await controller.reconciler.reconcile(("Job", ns, "train"))
        # The replacement hold: the noticed member stays listed (its rank trains on) while its standby starts.
        assert await asyncio.to_thread(membership) == first and first.get("standby") is True
        await asyncio.to_thread(run, standby, True)
        whole = await asyncio.to_thread(wait_until, lambda: told({spot[1], standby.spec.node_name},
                                                                 first["generation"]), 30, "the standby joined")
        assert whole["hosts"] == [spot[1], standby.spec.node_name] and whole["world_size"] == MAX
        assert whole["generation"] == first["generation"] + 1  # one change: the standby in, the noticed member out
        print(f"warm standby: notice -> spare placed {placed_after:.2f}s (fallback-after {FALLBACK_AFTER:g}s)")
        # The noticed member hands over and exits 83 (still before its node goes); its index comes back gated.
        await asyncio.to_thread(set_container_exit, control_plane, ns, leaving.metadata.name, names.EXIT_PREEMPTED)
        spare = await asyncio.to_thread(wait_until, gated_spare, 30, "the next spare, gated")
        assert spare.metadata.name != leaving.metadata.name

        # Swap-back: spot is free again; after return-after the spare goes to spot and takes the
        # on-demand member's place in one membership.
        spot.append(add_ready_node(control_plane, f"{pool}-spot-2", {CAPACITY: "spot", POOL: pool}))
        free_at = time.monotonic()
        joiner = (await asyncio.to_thread(wait_until, lambda: bound({spot[2]}), RETURN_AFTER + 30,
                                          "the spare placed on spot"))[0]
        assert time.monotonic() - free_at >= RETURN_AFTER
        assert joiner.metadata.name == spare.metadata.name and joiner.spec.node_selector[CAPACITY] == "spot"
        await asyncio.to_thread(run, joiner, False)
        await controller.reconciler.reconcile(("Job", ns, "train"))  # Running, not Ready: nothing changes
        assert await asyncio.to_thread(membership) == whole
        await asyncio.to_thread(run, joiner, True)
        swapped = await asyncio.to_thread(wait_until, lambda: told({spot[1], spot[2]}, whole["generation"]), 30,
                                          "the swap's membership")
        assert swapped["generation"] == whole["generation"] + 1  # one change: joined and left together
        assert swapped["hosts"] == [spot[1], spot[2]] and swapped["world_size"] == MAX
        await asyncio.to_thread(set_container_exit, control_plane, ns, standby.metadata.name, names.EXIT_PREEMPTED)
        assert await asyncio.to_thread(wait_until, gated_spare, 30, "the spare after the swap, gated")

        def all_spot():
            job = batch.read_namespaced_job("train", ns)
            record = json.loads(job.metadata.annotations[names.ANN_STATUS])
            return record if record.get("split") == {"spot": MAX, "on-demand": 0} else None
        await asyncio.to_thread(wait_until, all_spot, 30, "the record's split back to spot")
        job = batch.read_namespaced_job("train", ns)
        assert (job.spec.parallelism, job.spec.suspend) == (MAX + 1, False)
        assert not [c for c in job.status.conditions or [] if c.type == "Failed"]
    finally:
        await controller.stop()
    assert not refusals(caplog)


async def test_a_spare_without_start_at_min_gets_one_warning_and_the_job_is_left_alone(control_plane, k8s_namespace):
    api = control_plane.api_client()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    ns = pool = k8s_namespace
    add_ready_node(control_plane, f"{pool}-spot-0", {CAPACITY: "spot", POOL: pool})
    body = _job(pool)
    del body["metadata"]["annotations"][names.ANN_START_AT_MIN]
    batch.create_namespaced_job(ns, body)
    config = ControllerConfig(identity="supervisor-test", namespace=ns, resync=5.0)
    controller = Controller(Kube(control_plane.client_as("spotguard-supervisor")), config)
    await controller.start()
    try:
        def warnings():
            return [e for e in core.list_namespaced_event(ns).items if e.reason == names.EVENT_INVALID_POLICY]
        found = await asyncio.to_thread(wait_until, warnings, 30, "the Warning Event")
        assert found[0].type == "Warning" and names.ANN_START_AT_MIN in found[0].message
        await controller.reconciler.reconcile(("Job", ns, "train"))  # again: no second Event, nothing placed
        pods = core.list_namespaced_pod(ns, label_selector="batch.kubernetes.io/job-name=train").items
        assert len(pods) == MAX + 1 and all(p.spec.scheduling_gates and not p.spec.node_name for p in pods)
        assert len(warnings()) == 1
    finally:
        await controller.stop()
