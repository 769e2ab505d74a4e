"""The membership the supervisor pushes to a job's pods (annotation `spotguard.io/membership`).

Wire form: `wire.membership.Membership` (docs/protocols.md, read by the sidecar from its
downward-API file).
- hosts: the distinct nodes (default; `pod-ip` or `pod-name` on request) of the job's running
  replica pods on nodes without a notice, in completion-index order. Node names are the
  default because the sidecar marks a host departing when a notice's `node` names it.
- world_size: processes across those replicas: each replica counts its `nvidia.com/gpu`
  request (at least 1).
- generation: strictly increasing per job; the last pushed one is kept in the decision record.
- store (in-place jobs only, in_place.py): the first host's rendezvous store, and the hosts keep
  a stable order instead of the completion-index order.
- drain (optional): an id; the sidecar turns it into a `drain` notice for its ranks, so the job
  checkpoints and exits 83 (the supervisor's return to spot, fallback.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from spotguard.supervisor.capacity import pod_requests
from spotguard.wire import names
from spotguard.wire.membership import Membership

HOST_MODES = ("node", "pod-ip", "pod-name")
INDEX_KEYS = ("batch.kubernetes.io/job-completion-index", "training.kubeflow.org/replica-index")


def index_of(pod: Mapping[str, Any]) -> tuple[int, str]:
    """Sort key: the pod's completion (or replica) index, then its name; unindexed pods last."""
    meta = pod.get("metadata") or {}
    for source in (meta.get("annotations") or {}, meta.get("labels") or {}):
        for key in INDEX_KEYS:
            value = source.get(key)
            if value is not None and str(value).isdigit():
                return int(value), meta.get("name", "")
    return 1 << 30, meta.get("name", "")


def host_of(pod: Mapping[str, Any], mode: str = "node") -> str:
    if mode == "pod-ip":
        return (pod.get("status") or {}).get("podIP") or (pod.get("metadata") or {}).get("name", "")
    if mode == "pod-name":
        return (pod.get("metadata") or {}).get("name", "")
    return (pod.get("spec") or {}).get("nodeName") or ""


def hosts_of(pods: Iterable[Mapping[str, Any]], mode: str = "node") -> tuple[str, ...]:
    """Distinct hosts of `pods` (already filtered to the members) in completion-index order."""
    seen: list[str] = []
    for pod in sorted(pods, key=index_of):
        host = host_of(pod, mode)
        if host and host not in seen:
            seen.append(host)
    return tuple(seen)


def processes_per_replica(pod_spec: Mapping[str, Any] | None) -> int:
    return max(1, int(pod_requests(pod_spec).get("nvidia.com/gpu", 0)))


def membership_json(generation: int, hosts: Iterable[str], world_size: int, drain: str = "", store: str = "",
                    start: bool = False, standby: bool = False, first: Membership | None = None) -> str:
    """The wire form; `drain` (an id) asks every member to checkpoint and drain (a `drain` notice);
    `store` ("host:port") is where an in-place job's ranks re-form (in_place.py); `start`: the
    first group of a start-at-min job (its hosts start it together); `standby`: a noticed
    member's replacement is asked for at once (a backfill job with a spare), so its rank may
    train on until the replacement joins; `first`: the `start` membership a later one of a
    start-at-min job descends from."""
    return Membership(generation, tuple(hosts), world_size, drain, store, start, standby, first).to_json()


def pods_to_update(pods: Iterable[Mapping[str, Any]], value: str) -> list[Mapping[str, Any]]:
    """The pods whose membership annotation differs from `value`."""
    return [p for p in pods if ((p.get("metadata") or {}).get("annotations") or {}).get(names.ANN_MEMBERSHIP) != value]


def pod_patch(value: str) -> dict:
    return {"metadata": {"annotations": {names.ANN_MEMBERSHIP: value}}}
