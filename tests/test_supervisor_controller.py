"""The supervisor against a Kubernetes API over real HTTP (kmock + resourceVersion semantics).

Table-driven over the policies: each case starts a 4-replica job on 4 one-GPU nodes, puts a
reclaim notice on some of its nodes, checks the decision, then gives capacity back (and checks
the way back). Plus: a restart in the middle of a decision, malformed policy annotations, and
a Kubeflow PyTorchJob.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from spotguard.wire import names
from spotguard.kube.api import PYTORCHJOBS
from tests.supervisor_cluster import NS, eventually, running_cluster
from datetime import UTC

NODES = ["n0", "n1", "n2", "n3"]


def record_of(job: dict) -> dict:
    return json.loads(job["metadata"]["annotations"][names.ANN_STATUS])


def condition(job: dict, ctype: str) -> dict | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return None


@dataclass
class Case:
    name: str
    annotations: dict
    noticed: list[str]
    drain: bool  # a replica on a noticed node exits 83 (the Guard drained)
    after_notice: dict  # expected {"parallelism", "suspend", "phase", "event"}
    capacity_back: bool  # add a fresh node and expect the way back
    after_capacity: dict = field(default_factory=dict)
    writes: tuple = ()  # the job's spec states over time, (parallelism, suspend): each written once


def _w(*states):
    return tuple({"parallelism": p, "suspend": s} for p, s in states)


CASES = [
    Case("elastic-4-to-3", {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2"}, ["n0"], False,
         {"parallelism": 3, "suspend": False, "phase": "Running", "event": names.EVENT_SCALED},
         True, {"parallelism": 4, "suspend": False, "phase": "Running", "event": names.EVENT_SCALED},
         _w((4, False), (3, False), (4, False))),
    Case("fixed-suspend-resume", {names.ANN_POLICY: "fixed"}, ["n0"], True,
         {"parallelism": 4, "suspend": True, "phase": "Suspended", "event": names.EVENT_SUSPENDED},
         True, {"parallelism": 4, "suspend": False, "phase": "Running", "event": names.EVENT_RESUMED},
         _w((4, False), (4, True), (4, False))),
    Case("elastic-below-min-suspends", {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "4"}, ["n0"], False,
         {"parallelism": 4, "suspend": True, "phase": "Suspended", "event": names.EVENT_SUSPENDED},
         True, {"parallelism": 4, "suspend": False, "phase": "Running", "event": names.EVENT_RESUMED},
         _w((4, False), (4, True), (4, False))),
    Case("max-wait-expiry", {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "4", names.ANN_MAX_WAIT: "1"},
         ["n0"], False,
         {"parallelism": 4, "suspend": True, "phase": "GaveUp", "event": names.EVENT_MAX_WAIT}, False,
         writes=_w((4, False), (4, True))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_policy_table(case: Case):
    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODES, case.annotations)
        controller = cluster.controller()
        await controller.start()
        try:
            for node in case.noticed:
                await cluster.notice(node)
            if case.drain:
                async def checkpointing():
                    return record_of(await cluster.job("j1"))["phase"] == "Checkpointing"
                await eventually(checkpointing, what="checkpoint wait")
                assert (await cluster.job("j1"))["spec"]["suspend"] is False  # not before the checkpoint
                await cluster.exit_pod("j1", NODES.index(case.noticed[0]), names.EXIT_PREEMPTED)

            async def decided(expect=case.after_notice):
                job = await cluster.job("j1")
                rec = record_of(job) if names.ANN_STATUS in job["metadata"].get("annotations", {}) else {}
                assert rec.get("phase") == expect["phase"], rec
                spec = job["spec"]
                assert spec["parallelism"] == expect["parallelism"] and spec["suspend"] == expect["suspend"]
                assert await cluster.events("j1", expect["event"])
                return job

            job = await eventually(decided, what=f"{case.name}: decision on the notice")
            assert len(record_of(job)["handled"]) == len(case.noticed)
            suspended = condition(job, names.COND_SUSPENDED)
            if case.after_notice["suspend"]:
                await eventually(lambda: _cond_true(cluster, names.COND_SUSPENDED), what="suspended condition")
            else:
                assert suspended is None or suspended["status"] == "False"
            if case.after_notice["phase"] == "GaveUp":
                cond = await eventually(lambda: _cond_true(cluster, names.COND_MAX_WAIT), what="max-wait condition")
                assert "max-wait" in cond["message"]
                warning = (await cluster.events("j1", names.EVENT_MAX_WAIT))[0]
                assert warning["type"] == "Warning"
            if case.after_notice["parallelism"] == 3 and not case.after_notice["suspend"]:
                async def membership():
                    value = json.loads((await cluster.pod("j1-1"))["metadata"]["annotations"][names.ANN_MEMBERSHIP])
                    assert value["hosts"] == ["n1", "n2", "n3"] and value["world_size"] == 3 and value["v"] == 1
                    return value
                await eventually(membership, what="membership pushed")

            if case.capacity_back:
                await cluster.add_node("n4")

                async def back(expect=case.after_capacity):
                    job = await cluster.job("j1")
                    assert job["spec"]["parallelism"] == expect["parallelism"]
                    assert job["spec"]["suspend"] == expect["suspend"]
                    assert record_of(job)["phase"] == expect["phase"]
                    assert await cluster.events("j1", expect["event"])
                    return job
                await eventually(back, what=f"{case.name}: way back with capacity")
            else:
                await asyncio.sleep(0.5)  # nothing else may happen: GaveUp is final
                job = await cluster.job("j1")
                assert job["spec"]["suspend"] is True and record_of(job)["phase"] == "GaveUp"
            await asyncio.sleep(0.3)
            assert tuple(cluster.spec_writes("j1")) == case.writes  # each change once: no flapping, no repeats
        finally:
            await controller.stop()


async def _cond_true(cluster, ctype: str):
    cond = condition(await cluster.job("j1"), ctype)
    return cond if cond is not None and cond["status"] == "True" else None


async def test_restart_mid_decision_repeats_no_action():
    """The first supervisor's patch lands but its answer is lost (500) and the API is gone for it
    from then on until it dies, before the Event, conditions and membership; the next supervisor
    finishes them and does not scale again."""
    import kmock
    from kmock._internal.k8s import KubernetesError

    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODES, {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"})
        failed: list = []

        def first_spec_patch(request) -> bool:
            if failed or request.method.value.upper() != "PATCH" or not str(request.url.path).endswith("/jobs/j1"):
                return False
            failed.append(request)
            cluster.emulator.unavailable = True  # everything after the commit is lost
            return True

        cluster.emulator[kmock.resource("batch/v1/jobs")][first_spec_patch] << KubernetesError(
            status=500, reason="InternalError", message="connection lost after commit")
        first = cluster.controller("sup-a")
        await first.start()
        try:
            await cluster.notice("n0")
            await eventually(lambda: _ready(bool(failed)), what="the first patch")
        finally:
            await first.stop()
        cluster.emulator.unavailable = False
        job = await cluster.job("j1")
        assert job["spec"]["parallelism"] == 3  # the write landed although its caller saw a 500
        assert not await cluster.events("j1", names.EVENT_SCALED)

        second = cluster.controller("sup-b")
        await second.start()
        try:
            await eventually(lambda: cluster.events("j1", names.EVENT_SCALED), what="the Event of the decision")

            async def membership():
                return names.ANN_MEMBERSHIP in (await cluster.pod("j1-1"))["metadata"]["annotations"]
            await eventually(membership, what="membership")
            await asyncio.sleep(0.5)
            job = await cluster.job("j1")
            assert job["spec"]["parallelism"] == 3
            assert cluster.spec_writes("j1") == [
                {"parallelism": 4, "suspend": False},
                {"parallelism": 3, "suspend": False},
            ]
            assert len(await cluster.events("j1", names.EVENT_SCALED)) == 1
            assert record_of(job)["reclaims_survived"] == 1
        finally:
            await second.stop()


async def _ready(value):
    return value


MALFORMED = [
    ({names.ANN_POLICY: "elastik"}, names.ANN_POLICY),
    ({names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "two"}, names.ANN_MIN_REPLICAS),
    ({names.ANN_POLICY: "elastic", names.ANN_MAX_REPLICAS: "0"}, names.ANN_MAX_REPLICAS),
    ({names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "5", names.ANN_MAX_REPLICAS: "4"}, names.ANN_MIN_REPLICAS),
    ({names.ANN_POLICY: "fixed", names.ANN_MAX_WAIT: "-3"}, names.ANN_MAX_WAIT),
]


async def test_malformed_policy_annotation_event_names_field_and_job_untouched():
    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        for i, (annotations, _) in enumerate(MALFORMED):
            await cluster.add_job_with_pods(f"bad{i}", NODES, annotations)
        before = {i: cluster.job_versions(f"bad{i}") for i in range(len(MALFORMED))}
        controller = cluster.controller()
        await controller.start()
        try:
            await cluster.notice("n0")
            for i, (_, field_name) in enumerate(MALFORMED):
                events = await eventually(lambda: cluster.events(f"bad{i}", names.EVENT_INVALID_POLICY),
                                          what=f"invalid-policy Event for bad{i}")
                assert len(events) == 1 and events[0]["type"] == "Warning"
                assert field_name in events[0]["message"]
            await asyncio.sleep(0.3)
            for i in range(len(MALFORMED)):
                assert cluster.job_versions(f"bad{i}") == before[i]  # never written to
        finally:
            await controller.stop()


async def test_pytorchjob_elastic_scales_worker_replicas():
    async with running_cluster() as cluster:
        cluster.emulator.resources["kubeflow.org/v1/pytorchjobs"] = cluster.emulator.ResourceInfo(
            kind="PyTorchJob", namespaced=True, verbs=["get", "list", "watch", "patch", "create"])
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("pt", NODES, {names.ANN_POLICY: "elastic"}, kind="PyTorchJob")
        controller = cluster.controller()
        await controller.start()
        try:
            await cluster.notice("n2")

            async def scaled():
                job = await cluster.call(cluster.kube.get, PYTORCHJOBS, NS, "pt")
                return job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3 and job
            job = await eventually(scaled, what="PyTorchJob workers 4 -> 3")
            assert job["spec"]["runPolicy"]["suspend"] is False
            # The Event follows the patch (the decision's effects): wait for it, do not race it.
            await eventually(lambda: cluster.events("pt", names.EVENT_SCALED), what="the Event of the scale")
        finally:
            await controller.stop()


async def test_pytorchjob_in_place_keeps_its_workers_and_tells_the_survivors_the_store():
    """An in-place PyTorchJob: a notice scales no Worker replicas and suspends nothing; the
    survivors get the membership without the noticed host, with the first survivor's store."""
    async with running_cluster() as cluster:
        cluster.emulator.resources["kubeflow.org/v1/pytorchjobs"] = cluster.emulator.ResourceInfo(
            kind="PyTorchJob", namespaced=True, verbs=["get", "list", "watch", "patch", "create"])
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("pt", NODES, {names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true"},
                                        kind="PyTorchJob")
        controller = cluster.controller()
        await controller.start()
        try:
            await cluster.notice("n0")

            async def told():
                values = [json.loads((await cluster.pod(f"pt-{i}"))["metadata"]["annotations"][names.ANN_MEMBERSHIP])
                          for i in (1, 2, 3)]
                return all(v == values[0] for v in values) and values[0]
            membership = await eventually(told, what="the survivors told the membership")
            assert membership["hosts"] == ["n1", "n2", "n3"] and membership["store"] == f"10.0.0.2:{names.RDZV_PORT}"
            await eventually(lambda: cluster.events("pt", names.EVENT_LEAVING_IN_PLACE), what="the Event of the notice")
            job = await cluster.job("pt", kind="PyTorchJob")
            assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
            assert job["spec"]["runPolicy"]["suspend"] is False
            assert not await cluster.events("pt", names.EVENT_SCALED)
        finally:
            await controller.stop()


async def test_a_drain_before_the_notice_is_not_its_checkpoint():
    """restartPolicy OnFailure keeps an earlier drain's exit 83 in lastState: a new notice must
    still wait for a drain of its own (finishedAt at/after the notice) before suspending."""
    from datetime import datetime, timedelta

    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j1", NODES, {names.ANN_POLICY: "fixed"})
        await cluster.exit_pod("j1", 0, names.EXIT_PREEMPTED, restarted=True,
                               finished_at=datetime.now(UTC) - timedelta(hours=1))
        controller = cluster.controller()
        await controller.start()
        try:
            await cluster.notice("n0")

            async def checkpointing():
                return record_of(await cluster.job("j1"))["phase"] == "Checkpointing"
            await eventually(checkpointing, what="checkpoint wait")
            # Give a supervisor that took the old drain for this one time to suspend (the old
            # code did within milliseconds), then drain for real.
            await asyncio.sleep(1.0)
            job = await cluster.job("j1")
            assert job["spec"]["suspend"] is False and record_of(job)["phase"] == "Checkpointing", record_of(job)
            drained_at = datetime.now(UTC).replace(microsecond=0)
            await cluster.exit_pod("j1", 0, names.EXIT_PREEMPTED, restarted=True)

            async def suspended():
                job = await cluster.job("j1")
                rec = record_of(job)
                return job if job["spec"]["suspend"] is True and rec["phase"] == "Suspended" else None
            job = await eventually(suspended, what="suspension after the fresh drain")
            rec = record_of(job)
            assert rec["reason"] == "Checkpointed", rec
            assert datetime.fromisoformat(rec["decided_at"].replace("Z", "+00:00")) >= drained_at
        finally:
            await controller.stop()


async def test_a_short_on_demand_stint_is_counted_at_each_move():
    """The cost totals move at each change of a job's pods, not only every `cost_interval`: a pod
    that runs on an on-demand node for a moment between two spot stints is counted there."""
    import time

    async with running_cluster() as cluster:
        spot = {"karpenter.sh/capacity-type": "spot"}
        for node in NODES:
            await cluster.add_node(node, labels=spot)
        await cluster.add_node("od0")
        await cluster.add_node("n4", labels=spot)
        await cluster.add_job_with_pods("j1", NODES, {names.ANN_POLICY: "elastic"})
        controller = cluster.controller()
        controller.config.cost_interval = 3600.0  # the periodic count never runs in this test
        await controller.start()
        key = ("Job", NS, "j1")

        async def seen(pod: str, phase: str):
            return (controller.cache.pods.get((NS, pod)) or {}).get("status", {}).get("phase") == phase

        try:
            await cluster.exit_pod("j1", 0, 1)
            await cluster.add_pod("j1", 4, "od0")  # index 0 again, on an on-demand node
            await eventually(lambda: seen("j1-4", "Running"), what="the on-demand pod seen Running")
            started = time.monotonic()
            while time.monotonic() - started < 0.3:  # the stint's length, as the supervisor sees it
                await asyncio.sleep(0.05)
            await cluster.exit_pod("j1", 4, 1)
            await cluster.add_pod("j1", 5, "n4")  # back on spot
            await eventually(lambda: seen("j1-4", "Failed"), what="the on-demand pod seen gone")
            await eventually(lambda: seen("j1-5", "Running"), what="the spot pod seen Running")
            controller.costs.observe()
            entry = controller.ledger.jobs[key]
            assert entry.on_demand_hours * 3600 >= 0.3, entry
            assert entry.spot_hours > 0
        finally:
            await controller.stop()


async def test_no_cost_record_is_written_to_a_job_with_an_invalid_policy():
    """supervisor/README.md: a job whose policy annotations are invalid is never written to,
    the cost totals' save included (they are kept in memory and exported only)."""
    async with running_cluster() as cluster:
        for node in NODES:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("bad", NODES, {names.ANN_POLICY: "elastik"})
        await cluster.add_job_with_pods("good", NODES, {names.ANN_POLICY: "elastic"})
        controller = cluster.controller()
        controller.config.cost_interval = 3600.0
        await controller.start()
        try:
            await eventually(lambda: cluster.events("bad", names.EVENT_INVALID_POLICY), what="the Warning Event")
            before = cluster.job_versions("bad")
            controller.costs.observe()
            await asyncio.sleep(0.05)
            controller.costs.observe()  # both jobs now have node-hours to save
            assert controller.ledger.jobs[("Job", NS, "bad")].spot_hours + \
                controller.ledger.jobs[("Job", NS, "bad")].on_demand_hours > 0
            await controller.costs.save()
            assert cluster.job_versions("bad") == before  # never written to
            good = await cluster.job("good")
            assert record_of(good)["cost"]["on_demand_hours"] > 0  # the save itself works
        finally:
            await controller.stop()
