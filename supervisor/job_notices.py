"""What the notices on a job's nodes mean for the job at a time: the supervisor's one reading of
the agent's marks, through `spotguard.wire.notice_policy` (never a kind list of its own). Pure.

`read_job(pods, is_replica, notices, now)` takes every pod of the job and, for each known Node
those pods name, its notice (None: the Node carries none, or none this supervisor can read) and
returns a `JobReading`:
- `departing`: the nodes whose notice reads as a DEPARTURE at `now`;
- `hits`: one `NoticeHit` per departing node that runs an active replica, plus one per replica
  pod Kubernetes takes away (`DisruptionTarget`, disruption.py); these are what the policy acts on;
- `healthy`: active replica pods bound to a known node that is not departing and not taken away
  (the survivors): a rebalance (ADVICE) or a maintenance beyond the horizon (HELD) keeps them;
- `release_at`: the earliest time a HELD notice on those nodes becomes a departure (the
  controller looks again then).
A node marked in any way still stops counting as free capacity (capacity.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from spotguard.supervisor import capacity
from spotguard.supervisor.disruption import being_taken, disruption_deadline, disruption_of, hit_id
from spotguard.wire import notice_policy
from spotguard.wire.notice import Kind, Notice

Pod = Mapping[str, Any]


@dataclass(frozen=True)
class NoticeHit:
    """A notice that departs a node (or a pod) running at least one of the job's replicas.

    `from_node`: a node's notice (the agent's mark), which the cloud may withdraw; False for a
    pod Kubernetes takes away (disruption.py), which is never withdrawn. `released_at`: when a
    notice held at its detection became a departure (None: it was one from the start)."""

    id: str
    node: str
    kind: str
    deadline: datetime | None = None
    from_node: bool = True
    released_at: datetime | None = None


@dataclass(frozen=True)
class JobReading:
    """See the module docstring."""

    hits: tuple[NoticeHit, ...] = ()
    healthy: int = 0
    departing: frozenset[str] = frozenset()
    release_at: datetime | None = None


def disruption_hits(pods: Iterable[Pod], is_replica: Callable[[Pod], bool]) -> list[NoticeHit]:
    """One hit per replica pod Kubernetes takes away, bound and not finished (Terminating
    included), in the order of `pods`: id `<reason>/<pod name>/<uid prefix>`, node the pod's
    node, kind `drain`, deadline the end of its grace period (disruption.py)."""
    hits = []
    for pod in pods:
        condition = disruption_of(pod)
        if condition is None or not being_taken(pod) or not is_replica(pod):
            continue
        node = str((pod.get("spec") or {}).get("nodeName"))
        hits.append(NoticeHit(hit_id(pod, condition), node, Kind.DRAIN.value, disruption_deadline(pod),
                              from_node=False))
    return hits


def read_job(pods: Iterable[Pod], is_replica: Callable[[Pod], bool], notices: Mapping[str, Notice | None],
             now: datetime, horizon_seconds: float = notice_policy.HORIZON_SECONDS) -> JobReading:
    """See the module docstring. `notices`: known node name -> its notice or None;
    `horizon_seconds`: the job's (its Guard's) notice horizon."""
    pods = list(pods)
    departing = notice_policy.departing_nodes(notices.items(), now, horizon_seconds=horizon_seconds)
    hits = disruption_hits(pods, is_replica)
    healthy = 0
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if not capacity.pod_active(pod) or not is_replica(pod) or node not in notices or disruption_of(pod):
            continue
        notice = notices[node]
        if node in departing and notice is not None:
            released = notice_policy.read(notice, notice.detected_at, horizon_seconds=horizon_seconds).release_at
            hits.append(NoticeHit(notice.id, node, notice.kind.value, notice.deadline, released_at=released))
        else:
            healthy += 1
    return JobReading(tuple({h.id: h for h in hits}.values()), healthy, departing,
                      notice_policy.next_release(notices.values(), now, horizon_seconds=horizon_seconds))
