"""The in-place membership through the whole controller, over real HTTP (kmock + resourceVersion
semantics): which replacements are admitted, how many at once, and what a relaunched job gets
after its in-place group is gone. The same on a real kube-apiserver: tests/test_k8s_in_place.py."""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from spotguard.kube.api import NODES, PODS
from spotguard.wire import names
from tests.supervisor_cluster import NS, eventually, running_cluster

IN_PLACE = {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2", names.ANN_IN_PLACE: "true"}
KEY = ("Job", NS, "j")
SIX = ("n0", "n1", "n2", "n3", "n4", "n5")


def record_of(job: dict) -> dict:
    return json.loads(job["metadata"]["annotations"][names.ANN_STATUS])


async def membership_of(cluster, pod: str) -> dict | None:
    text = ((await cluster.pod(pod))["metadata"].get("annotations") or {}).get(names.ANN_MEMBERSHIP)
    return json.loads(text) if text else None


def members_history(cluster) -> list[list[str]]:
    """The distinct `members` the job's record went through, in order."""
    out: list[list[str]] = []
    for version in cluster.job_versions("j"):
        text = ((version.get("metadata") or {}).get("annotations") or {}).get(names.ANN_STATUS)
        members = json.loads(text).get("members", []) if text else []
        if members and (not out or out[-1] != members):
            out.append(members)
    return out


async def set_status(cluster, pod: str, *, ready: bool | None = None, restarts: int | None = None) -> None:
    status: dict = {"phase": "Running"}
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    if restarts is not None:
        status["containerStatuses"] = [{"name": "train", "restartCount": restarts, "state": {"running": {}}}]
    await cluster.call(cluster.kube.patch, PODS, NS, pod, {"status": status})


async def seen(controller, pod: str, check) -> bool:
    cached = controller.cache.pods.get((NS, pod))
    return cached is not None and check(cached)


def ready(p: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (p.get("status") or {}).get("conditions") or [])


async def survivors_told(cluster, pods: list[str], hosts: list[str]) -> dict:
    async def told():
        values = [await membership_of(cluster, p) for p in pods]
        return all(v is not None and v["hosts"] == hosts for v in values) and values[0]
    return await eventually(told, what=f"the membership {hosts}")


@contextlib.asynccontextmanager
async def in_place_cluster(nodes: tuple[str, ...], join_settle: float) -> AsyncIterator[tuple]:
    """Nodes `nodes`, the in-place Job "j" with pods j-0..j-3 on n0..n3, and a started controller
    whose Ready joiners wait at most `join_settle` s for replacements still starting."""
    async with running_cluster() as cluster:
        for node in nodes:
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j", ["n0", "n1", "n2", "n3"], IN_PLACE)
        controller = cluster.controller(join_settle=join_settle)
        await controller.start()
        try:
            yield cluster, controller
        finally:
            await controller.stop()


async def two_left(cluster, controller) -> dict:
    """n0 and n1 get a notice; their pods exit 83; replacements j-4 (index 0) on n4 and j-5
    (index 1) on n5 run, not Ready yet. Returns the survivors' membership."""
    await cluster.notice("n0")
    await cluster.notice("n1", ident="2")
    first = await survivors_told(cluster, ["j-2", "j-3"], ["n2", "n3"])
    for index in (0, 1):
        await cluster.exit_pod("j", index, names.EXIT_PREEMPTED)
    for index, node in ((0, "n4"), (1, "n5")):
        await cluster.add_pod("j", index + 4, node)
        await cluster.call(cluster.kube.patch, PODS, NS, f"j-{index + 4}", {"metadata": {"annotations": {
            "batch.kubernetes.io/job-completion-index": str(index)}}})
        await set_status(cluster, f"j-{index + 4}", ready=False)
    for pod in ("j-4", "j-5"):
        await eventually(lambda pod=pod: seen(controller, pod, lambda p: not ready(p)), what=f"{pod} seen")
    return first


async def test_replacements_ready_together_join_in_one_change():
    """Two replacements become Ready one after the other: the first waits for the second (it
    is still starting), and both are appended in ONE membership push (one change, not two)."""
    async with in_place_cluster(SIX, join_settle=60.0) as (cluster, controller):
        first = await two_left(cluster, controller)
        await set_status(cluster, "j-4", ready=True)
        await eventually(lambda: seen(controller, "j-4", ready), what="j-4 seen Ready")
        await controller.reconciler.reconcile(KEY)  # a pass that sees j-4 Ready and j-5 starting
        assert (await membership_of(cluster, "j-2"))["hosts"] == ["n2", "n3"]
        held = record_of(await cluster.job("j")).get("ready_seen") or {}
        assert list(held) == ["j-4"]  # the settle window's clock is in the record (kmock gives pods no uid)
        await set_status(cluster, "j-5", ready=True)
        both = await survivors_told(cluster, ["j-2", "j-3", "j-4", "j-5"], ["n2", "n3", "n4", "n5"])
        assert both["generation"] == first["generation"] + 1 and both["world_size"] == 4
        history = members_history(cluster)  # (n1, n2, n3) first, when n0's notice was seen alone
        assert history[history.index(["n2", "n3"]):] == [["n2", "n3"], ["n2", "n3", "n4", "n5"]]


async def test_a_ready_joiner_waits_for_a_stuck_peer_no_longer_than_the_settle_window():
    async with in_place_cluster(SIX, join_settle=0.5) as (cluster, controller):
        await two_left(cluster, controller)
        await set_status(cluster, "j-4", ready=True)  # j-5 never becomes Ready
        await survivors_told(cluster, ["j-2", "j-3", "j-4"], ["n2", "n3", "n4"])


async def test_a_joiner_on_a_node_noticed_while_it_became_ready_is_not_admitted():
    """A replacement runs on n4; n4 gets a notice whose deadline has passed while the pod is
    still becoming Ready; the pod then becomes Ready: it is never added, and its peer on a
    healthy node (Ready too) is."""
    async with in_place_cluster(SIX, join_settle=60.0) as (cluster, controller):
        await two_left(cluster, controller)
        await cluster.notice("n4", deadline_in=-5.0, ident="3")  # reclaimed: its deadline already passed
        await eventually(lambda: _has_notice(controller, "n4"), what="n4's notice seen")
        await set_status(cluster, "j-4", ready=True)
        await set_status(cluster, "j-5", ready=True)
        await eventually(lambda: seen(controller, "j-4", ready), what="j-4 seen Ready")
        grown = await survivors_told(cluster, ["j-2", "j-3", "j-5"], ["n2", "n3", "n5"])
        await controller.reconciler.reconcile(KEY)  # one more pass that sees everything
        assert (await membership_of(cluster, "j-2")) == grown
        assert all("n4" not in members for members in members_history(cluster))


async def _has_notice(controller, node: str) -> bool:
    return names.ANN_NOTICE in ((controller.cache.nodes.get(node) or {}).get("metadata", {}).get("annotations") or {})


async def test_after_every_member_restarted_the_relaunched_job_gets_its_own_membership():
    """restartPolicy OnFailure: after a fallback every member's container restarts in its pod
    (same pods, same stale annotation: n0's pod, whose notice was withdrawn, was never in it).
    The supervisor sees the group gone and pushes the relaunched group as a new generation: every
    host, completion-index order, index 0's store; so every worker starts (join rule)."""
    async with in_place_cluster(("n0", "n1", "n2", "n3"), join_settle=10.0) as (cluster, controller):
        await cluster.notice("n0")
        first = await survivors_told(cluster, ["j-1", "j-2", "j-3"], ["n1", "n2", "n3"])
        await eventually(lambda: _recorded_pods(cluster, 3), what="the member pods recorded")
        await cluster.call(cluster.kube.patch, NODES, None, "n0", {  # the notice is withdrawn
            "metadata": {"annotations": {names.ANN_NOTICE: None}}, "spec": {"taints": []}})
        await eventually(lambda: _no_notice(controller, "n0"), what="n0's withdrawal seen")
        for index in (1, 2):  # restarting: not every member yet, the group is not gone
            await set_status(cluster, f"j-{index}", restarts=1)
        await eventually(lambda: seen(controller, "j-2", lambda p: p["status"].get("containerStatuses")),
                         what="j-2's restart seen")
        await controller.reconciler.reconcile(KEY)
        assert await membership_of(cluster, "j-1") == first
        for index in (0, 3):
            await set_status(cluster, f"j-{index}", restarts=1)
        pods = ["j-0", "j-1", "j-2", "j-3"]
        fresh = await survivors_told(cluster, pods, ["n0", "n1", "n2", "n3"])
        assert fresh["generation"] == first["generation"] + 1 and fresh["world_size"] == 4
        assert fresh["store"] == f"10.0.0.1:{names.RDZV_PORT}"  # index 0's pod: rank 0 of the first group
        record = record_of(await cluster.job("j"))
        assert record["members"] == ["n0", "n1", "n2", "n3"] and len(record["member_pods"]) == 4


async def _no_notice(controller, node: str) -> bool:
    return not await _has_notice(controller, node)


async def _recorded_pods(cluster, count: int) -> bool:
    return len(record_of(await cluster.job("j")).get("member_pods", [])) == count


async def test_a_pass_writes_the_job_once():
    """A notice on n0 and the drained exit of n0's rank (with its steps lost), both there when the
    supervisor starts: ONE pass decides (the in-place notice), counts the steps lost and makes the
    membership without n0, and writes the job ONCE (spec, record and annotations; before: the
    decision, the steps lost and the membership's generation were three writes) plus its status
    (the conditions: a separate endpoint); then the pods are told."""
    async with running_cluster() as cluster:
        for node in ("n0", "n1", "n2", "n3"):
            await cluster.add_node(node)
        await cluster.add_job_with_pods("j", ["n0", "n1", "n2", "n3"], IN_PLACE)
        await cluster.notice("n0")
        finished = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        drained = {"terminated": {"exitCode": names.EXIT_PREEMPTED, "finishedAt": finished,
                                  "message": json.dumps({"v": 1, "steps_lost": 3})}}
        await cluster.call(cluster.kube.patch, PODS, NS, "j-0", {"status": {"phase": "Running", "containerStatuses": [
            {"name": "train", "state": {"running": {}}, "lastState": drained}]}})  # restartPolicy OnFailure
        writes: list[tuple[str, str | None]] = []
        cluster.emulator.on_write = lambda r: writes.append((r.name, r.subresource)) \
            if r.resource is not None and r.resource.plural == "jobs" else None
        controller = cluster.controller()
        await controller.start()
        try:
            told = await survivors_told(cluster, ["j-1", "j-2", "j-3"], ["n1", "n2", "n3"])
            await eventually(lambda: cluster.events("j", names.EVENT_LEAVING_IN_PLACE), what="the Event")
            await controller.reconciler.reconcile(KEY)  # one more pass: nothing left to write
            job = await cluster.job("j")
            record = record_of(job)
            assert record["generation"] == told["generation"] == 1 and record["steps_lost"] == 3
            assert record["event"] == names.EVENT_LEAVING_IN_PLACE
            assert job["metadata"]["annotations"][names.ANN_STEPS_LOST] == "3"
            assert sorted(writes, key=repr) == sorted([("j", None), ("j", "status")], key=repr), writes
        finally:
            await controller.stop()
