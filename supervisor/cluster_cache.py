"""The supervisor's view of the cluster: Nodes, Pods and managed jobs, with the indexes the
controller reads, filled by informer events (on the event loop, never blocking).

Contract:
- `apply_node(kind, payload)`, `apply_pod(kind, payload)`, `apply_job(adapter, kind, payload)`
  take informer events ("SYNC" with the full list, or ADDED/MODIFIED/DELETED) and return the
  keys of the jobs the change may concern, most concerned first: a node's change -> the jobs
  with pods there first, then (a node that turned healthy, or an active pod that ended) the
  jobs waiting for capacity;
- reads are pure: `node_notice` (parsed once per annotation value), `pods_of`, `replica_pods`,
  `free_slots` (memoized per pod shape until something that moves capacity changes),
  `notice_seen_at` (when the supervisor first saw the notice on a job's nodes). What a notice
  means for a job is not the cache's to say: job_notices.py reads it (notice_policy).
"""
from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Mapping

from spotguard.wire.notice import Notice, NoticeFormatError
from spotguard.supervisor import capacity
from spotguard.wire import names
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.decision import ELASTIC

log = logging.getLogger(__name__)

JobKey = tuple[str, str, str]  # (kind, namespace, name)
PodKey = tuple[str, str]


def meta(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """An object's metadata ({} when absent)."""
    return (obj or {}).get("metadata") or {}


def annotations_of(obj: Mapping[str, Any] | None) -> Mapping[str, str]:
    return meta(obj).get("annotations") or {}


def _pod_signature(pod: Mapping[str, Any] | None) -> tuple:
    """What of a pod moves free capacity (not its annotations)."""
    if pod is None:
        return ()
    spec = pod.get("spec") or {}
    return (spec.get("nodeName"), (pod.get("status") or {}).get("phase"), meta(pod).get("deletionTimestamp"),
            repr([c.get("resources") for c in spec.get("containers") or []]))


def _node_signature(node: Mapping[str, Any] | None) -> tuple:
    if node is None:
        return ()
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    return (annotations_of(node).get(names.ANN_NOTICE), repr(spec.get("taints")),
            spec.get("unschedulable"), capacity.node_ready(node), repr(status.get("allocatable")),
            repr(meta(node).get("labels")))


class ClusterCache:
    """See the module docstring. `adapters`: job kind -> JobAdapter (to find a pod's owner)."""

    def __init__(self, adapters: Mapping[str, JobAdapter]):
        self.adapters = adapters
        self.nodes: dict[str, dict] = {}
        self.pods: dict[PodKey, dict] = {}
        self.jobs: dict[JobKey, dict] = {}
        self._pods_by_node: dict[str, set[PodKey]] = {}
        self._pods_by_owner: dict[JobKey, set[PodKey]] = {}
        self._pod_owner: dict[PodKey, JobKey] = {}
        self._pod_node: dict[PodKey, str] = {}
        self._notice_cache: dict[str, Notice | None] = {}
        self._notice_seen_at: dict[str, float] = {}
        self._capacity_generation = 0  # bumped by every change that can move free capacity
        self._capacity_cache: dict[tuple, tuple[int, int]] = {}

    # ---- informer events -------------------------------------------------------------------
    def apply_node(self, kind: str, payload: Any) -> list[JobKey]:
        if kind == "SYNC":
            self.nodes = {name: n for n in payload if (name := meta(n).get("name"))}
            self._notice_cache.clear()
            self._capacity_generation += 1
            return list(self.jobs)
        name = meta(payload).get("name")
        if not name:
            return []
        old = self.nodes.get(name)
        if kind == "DELETED":
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = payload
        new = self.nodes.get(name)
        if _node_signature(old) == _node_signature(new):
            return []
        self._capacity_generation += 1
        notice_text = annotations_of(new).get(names.ANN_NOTICE) if new else None
        if notice_text and notice_text != (annotations_of(old).get(names.ANN_NOTICE) if old else None):
            self._notice_seen_at[name] = time.monotonic()
        wake = [owner for owner in (self._pod_owner.get(p) for p in self._pods_by_node.get(name, ()))
                if owner in self.jobs]
        if new is not None and capacity.node_healthy(new):
            wake += self.waiting_jobs()
        return wake

    def apply_pod(self, kind: str, payload: Any) -> list[JobKey]:
        if kind == "SYNC":
            for key in list(self.pods):
                self._unindex_pod(key)
            self.pods.clear()
            for pod in payload:
                self._index_pod(pod)
            self._capacity_generation += 1
            return list(self.jobs)
        key = (meta(payload).get("namespace", ""), meta(payload).get("name", ""))
        old = self.pods.get(key)
        was_active = old is not None and capacity.pod_active(old)
        if _pod_signature(old) != _pod_signature(payload if kind != "DELETED" else None):
            self._capacity_generation += 1
        self._unindex_pod(key)
        if kind != "DELETED":
            self._index_pod(payload)
        owner = self._pod_owner.get(key) or self._owner_of(payload)
        wake = [owner] if owner in self.jobs else []
        if was_active and (kind == "DELETED" or not capacity.pod_active(payload)):
            wake += self.waiting_jobs()
        return wake

    def apply_job(self, adapter: JobAdapter, kind: str, payload: Any) -> tuple[list[JobKey], JobKey | None]:
        """(the jobs now in the cache that this event concerns, the job it deleted or None)."""
        if kind == "SYNC":
            for key in [k for k in self.jobs if k[0] == adapter.kind]:
                self.jobs.pop(key)
            seen = []
            for obj in payload:
                key = (adapter.kind, meta(obj).get("namespace", ""), meta(obj).get("name", ""))
                self.jobs[key] = obj
                seen.append(key)
            return seen, None
        key = (adapter.kind, meta(payload).get("namespace", ""), meta(payload).get("name", ""))
        if kind == "DELETED":
            self.jobs.pop(key, None)
            return [], key
        self.jobs[key] = payload
        return [key], None

    def waiting_jobs(self) -> list[JobKey]:
        """Jobs that may use freed capacity: suspended by us, or elastic below their max."""
        waiting = []
        for key, obj in self.jobs.items():
            annotations = annotations_of(obj)
            status = annotations.get(names.ANN_STATUS) or ""
            if ('"phase":"Suspended"' in status or '"capacity":"on-demand"' in status
                    or annotations.get(names.ANN_POLICY) == ELASTIC):
                waiting.append(key)
        return waiting

    def _owner_of(self, pod: Mapping[str, Any]) -> JobKey | None:
        for ref in meta(pod).get("ownerReferences") or []:
            if not ref.get("controller", True):
                continue
            for adapter in self.adapters.values():
                if adapter.owns(ref):
                    return (adapter.kind, meta(pod).get("namespace", ""), ref.get("name", ""))
        return None

    def _index_pod(self, pod: dict) -> None:
        key = (meta(pod).get("namespace", ""), meta(pod).get("name", ""))
        self.pods[key] = pod
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            self._pods_by_node.setdefault(node, set()).add(key)
            self._pod_node[key] = node
        owner = self._owner_of(pod)
        if owner is not None:
            self._pods_by_owner.setdefault(owner, set()).add(key)
            self._pod_owner[key] = owner

    def _unindex_pod(self, key: PodKey) -> None:
        self.pods.pop(key, None)
        node = self._pod_node.pop(key, None)
        if node is not None:
            self._pods_by_node.get(node, set()).discard(key)
        owner = self._pod_owner.pop(key, None)
        if owner is not None:
            self._pods_by_owner.get(owner, set()).discard(key)

    # ---- reads -----------------------------------------------------------------------------
    def node_notice(self, node: Mapping[str, Any] | None) -> Notice | None:
        """The node's notice (parsed once per annotation value); None if absent or unreadable."""
        if node is None:
            return None
        text = annotations_of(node).get(names.ANN_NOTICE)
        if not text:
            return None
        if text not in self._notice_cache:
            try:
                self._notice_cache[text] = Notice.from_json(text)
            except NoticeFormatError as exc:
                log.warning("node %s: ignoring unreadable %s annotation: %s", meta(node).get("name"), names.ANN_NOTICE,
                            exc)
                self._notice_cache[text] = None
            if len(self._notice_cache) > 10000:
                self._notice_cache.clear()
        return self._notice_cache.get(text)

    def pods_of(self, key: JobKey) -> list[dict]:
        """Every cached pod the job owns."""
        return [self.pods[k] for k in self._pods_by_owner.get(key, ()) if k in self.pods]

    def replica_pods(self, key: JobKey, adapter: JobAdapter) -> list[dict]:
        """The job's active replica pods."""
        return [p for p in self.pods_of(key) if capacity.pod_active(p) and adapter.is_replica_pod(p)]

    def notice_seen_at(self, key: JobKey) -> float | None:
        """The monotonic time the latest notice on one of the job's nodes was first seen."""
        seen = [self._notice_seen_at.get(self._pod_node.get(p, "")) for p in self._pods_by_owner.get(key, ())]
        known = [s for s in seen if s is not None]
        return max(known) if known else None

    def free_slots(self, key: JobKey, pod_spec: Mapping[str, Any], ignore_own: bool) -> int:
        """capacity.free_slots over the caches, memoized per pod shape until capacity changes."""
        shape = repr((pod_spec.get("containers") and [c.get("resources") for c in pod_spec["containers"]],
                      pod_spec.get("initContainers") and [c.get("resources") for c in pod_spec["initContainers"]],
                      pod_spec.get("nodeSelector"), pod_spec.get("affinity"), pod_spec.get("tolerations")))
        cache_key = (shape, key if ignore_own else None)
        cached = self._capacity_cache.get(cache_key)
        if cached is not None and cached[0] == self._capacity_generation:
            return cached[1]
        own = set(self._pods_by_owner.get(key, ())) if ignore_own else set()
        ignore = (lambda p: (meta(p).get("namespace", ""), meta(p).get("name", "")) in own) if ignore_own else None
        by_node = {n: [self.pods[k] for k in ks if k in self.pods] for n, ks in self._pods_by_node.items() if ks}
        value = capacity.free_slots(self.nodes.values(), by_node, pod_spec, ignore)
        if len(self._capacity_cache) > 4096:
            self._capacity_cache.clear()
        self._capacity_cache[cache_key] = (self._capacity_generation, value)
        return value

    def running_nodes(self, key: JobKey, adapter: JobAdapter) -> list[dict]:
        """The cached Nodes that run one of the job's Running replica pods."""
        names_ = {(p.get("spec") or {}).get("nodeName") for p in self.replica_pods(key, adapter)
                  if (p.get("status") or {}).get("phase") == "Running"}
        return [self.nodes[n] for n in names_ if n in self.nodes]
