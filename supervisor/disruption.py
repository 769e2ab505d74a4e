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
- `hit_id(pod, condition)` names the notice it gives its job: `<reason>/<pod name>/<uid prefix>`
  (stable for the pod's life, readable in the decision's Event), and `disruption_deadline(pod)`
  its deadline, the pod's `deletionTimestamp` (the end of its grace period) when it has one.
  job_notices.py makes one departing `NoticeHit` (kind `drain`, never withdrawn) per disrupted
  replica pod still bound and not finished; the policy handles it as any notice (in place: the
  ranks there leave, the others re-form; elastic: scale to the survivors; fixed: checkpoint,
  then suspend), once (the record's `handled`).
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from spotguard.wire.notice import NoticeFormatError, parse_time

CONDITION = "DisruptionTarget"


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


def disruption_deadline(pod: Mapping[str, Any]) -> datetime | None:
    """The end of the pod's grace period (its `deletionTimestamp`), None when not set or unreadable."""
    raw = (pod.get("metadata") or {}).get("deletionTimestamp")
    if not raw:
        return None
    try:
        return parse_time(raw, "deletionTimestamp")
    except NoticeFormatError:
        return None
