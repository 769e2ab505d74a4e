"""supervisor/disruption.py: which pods Kubernetes is taking away (`DisruptionTarget=True`) and the
notice each gives its job; the membership never counts such a pod as a member."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

from spotguard.supervisor.disruption import disrupted
from spotguard.supervisor.job_notices import disruption_hits
from spotguard.supervisor.membership_plan import JobPods


def pod(name: str, reason: str | None = "PreemptionByScheduler", *, status: str = "True", phase: str = "Running",
        node: str | None = "n1", deleting: str | None = "2026-11-25T22:00:30Z", replica: bool = True) -> dict:
    conditions = [{"type": "Ready", "status": "True"}]
    if reason is not None:
        conditions.append({"type": "DisruptionTarget", "status": status, "reason": reason})
    meta = {"name": name, "namespace": "train", "uid": f"{name}-0123456789",
            "labels": {"role": "worker" if replica else "master"}}
    if deleting:
        meta["deletionTimestamp"] = deleting
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": conditions}}


def is_replica(p: dict) -> bool:
    return p["metadata"]["labels"]["role"] == "worker"


@pytest.mark.parametrize("reason", ["PreemptionByScheduler", "EvictionByEvictionAPI", "DeletionByTaintManager",
                                    "TerminationByKubelet"])
def test_each_disruption_is_one_notice_for_its_pod(reason):
    [hit] = disruption_hits([pod("train-1", reason)], is_replica)
    assert hit.id == f"{reason}/train-1/train-1-"  # the uid's first 8 characters keep it one pod's
    assert (hit.node, hit.kind, hit.from_node) == ("n1", "drain", False)  # a pod's: never withdrawn
    assert hit.deadline == datetime(2026, 11, 25, 22, 0, 30, tzinfo=UTC)  # the end of its grace period


def test_only_live_disrupted_replica_pods_give_notices():
    pods = [pod("healthy", None), pod("false", status="False"), pod("done", phase="Failed"),
            pod("unbound", node=None), pod("master", replica=False), pod("no-deadline", deleting=None)]
    hits = disruption_hits(pods, is_replica)
    assert [h.id.split("/")[1] for h in hits] == ["no-deadline"] and hits[0].deadline is None
    assert [disrupted(p) for p in pods[:2]] == [False, False]


def test_a_disrupted_pod_is_never_a_member():
    pods = JobPods(nodes=frozenset({"n1"}))
    assert pods.on_healthy_node(pod("kept", None, deleting=None))
    assert not pods.on_healthy_node(pod("preempted", deleting=None))  # condition set, delete not seen yet
    assert not pods.on_departing_node(pod("preempted", deleting=None))
