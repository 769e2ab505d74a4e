"""Pods that Kubernetes itself is taking away: the pod condition `DisruptionTarget=True`. Pure.

The scheduler sets it on a victim of preemption (reason `PreemptionByScheduler`), the eviction
API on an evicted pod (`EvictionByEvictionAPI`, e.g. `kubectl drain`), the taint manager on a
pod of a NoExecute-tainted node (`DeletionByTaintManager`), the pod GC and the kubelet on others
(`DeletionByPodGC`, `TerminationByKubelet`); each sets the condition through `pods/status` before
(or while) it deletes the pod. The supervisor treats it as a notice for that one pod, never for
its node: the node stays healthy (the preemptor is about to run there), so nothing is tainted or
annotated. The pod's ranks get SIGTERM from the kubelet, which the Guard turns into a drain.

Contract:
- `disruption_of(pod)` is the condition when it is True, else None;
- `disrupted(pod)` says whether the pod is leaving that way: it is no member and no survivor;
- `disruption_hits(pods, is_replica)` gives one `NoticeHit` per disrupted replica pod still
  bound and not finished (Terminating included): id `<reason>/<pod name>/<uid prefix>` (stable
  for the pod's life, readable in the decision's Event), node the pod's node, kind `drain`,
  deadline the pod's `deletionTimestamp` (the end of its grace period) when it has one. The
  policy handles it as any notice (in place: the ranks there leave, the others re-form; elastic:
  scale to the survivors; fixed: checkpoint, then suspend), once (the record's `handled`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from spotguard.wire.notice import Kind, NoticeFormatError, parse_time
from spotguard.supervisor.policy import NoticeHit

CONDITION = "DisruptionTarget"
TERMINAL_PHASES = ("Succeeded", "Failed")


def disruption_of(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's `DisruptionTarget` condition when its status is True, else None."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == CONDITION and cond.get("status") == "True":
            return cond
    return None


def disrupted(pod: Mapping[str, Any]) -> bool:
    return disruption_of(pod) is not None


def hit_id(pod: Mapping[str, Any], condition: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = str(meta.get("uid") or "")[:8]
    return f"{condition.get('reason') or CONDITION}/{meta.get('name', '')}/{uid}"


def disruption_hits(pods: Iterable[Mapping[str, Any]],
                    is_replica: Callable[[Mapping[str, Any]], bool]) -> list[NoticeHit]:
    """The module docstring's hits, in the order of `pods`."""
    hits = []
    for pod in pods:
        condition = disruption_of(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        if condition is None or not node or not is_replica(pod):
            continue
        if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        deadline = None
        raw = (pod.get("metadata") or {}).get("deletionTimestamp")
        if raw:
            try:
                deadline = parse_time(raw, "deletionTimestamp")
            except NoticeFormatError:
                deadline = None
        hits.append(NoticeHit(hit_id(pod, condition), str(node), Kind.DRAIN.value, deadline))
    return hits
