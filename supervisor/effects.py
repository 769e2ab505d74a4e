"""The controller's writes: the job's conditional patch and what follows it (the Event, the
conditions on the job's status, the membership on the pods).

Contract:
- nothing is written unless `is_leader()`; every write of the job carries the cached object's
  `metadata.resourceVersion` as precondition (`conditional`): a 409 re-reads the job into the
  cache and requeues it (the reconciler decides again on the fresh object), a 404 drops it;
- the reconciler writes the job once per pass (`write_job`: spec change, record, steps lost);
  the conditions live in the status subresource, a separate endpoint: `ensure_conditions`
  patches it only when the record's conditions differ from the job's (a decision changed them);
- `ensure_event`, `ensure_placement_event` and `ensure_conditions` are idempotent: each compares
  what is there with what the record implies and writes only the difference; a decision's Event
  is named after its idempotency key, a backfill placement's after the placement (its time and
  text), so 409 AlreadyExists = posted before. `push_membership` writes the pods the
  decision's membership names (membership_plan.py decided which, and what).
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Mapping

from spotguard.kube.api import EVENTS, PODS, Conflict, Kube, NotFound, Resource
from spotguard.supervisor import conditions, membership
from spotguard.wire import names
from spotguard.wire.notice import format_time
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, meta
from spotguard.supervisor.decision import decision_key
from spotguard.supervisor.events import event_body
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.membership_plan import MembershipPush
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.policy import PolicyError
from spotguard.supervisor.record import Record

log = logging.getLogger(__name__)

WARNING_EVENTS = (names.EVENT_MAX_WAIT, names.EVENT_SUSPENDED, names.EVENT_FELL_BACK)


def now() -> datetime:
    return datetime.now(UTC)


def conditional(obj: Mapping[str, Any], body: dict) -> dict:
    """`body` with the object's resourceVersion as the write's precondition (when it has one)."""
    version = meta(obj).get("resourceVersion")
    if version:
        body.setdefault("metadata", {})["resourceVersion"] = version
    return body


def record_patch(obj: Mapping[str, Any], record: Record, **annotations: str) -> dict:
    """The conditional patch that writes the decision record (and further annotations)."""
    return conditional(obj, {"metadata": {"annotations": {names.ANN_STATUS: record.to_json(), **annotations}}})


class JobEffects:
    """See the module docstring."""

    def __init__(self, kube: Kube, cache: ClusterCache, *, identity: str, metrics: SupervisorMetrics,
                 is_leader: Callable[[], bool], requeue: Callable[..., None]):
        self.kube = kube
        self.cache = cache
        self.identity = identity
        self.metrics = metrics
        self.is_leader = is_leader
        self.requeue = requeue
        # Write-avoidance caches, not state: an Event posted again is refused (409, its name is its key).
        self._evented: set[str] = set()
        self._reported_invalid: dict[JobKey, str] = {}

    async def write_job(self, key: JobKey, adapter: JobAdapter, body: dict, *, status: bool = False) -> dict | None:
        """One patch of the job (or its status); the new object, or None when it must be re-decided."""
        if not self.is_leader():
            return None
        try:
            new = await asyncio.to_thread(self.kube.patch, adapter.resource, key[1], key[2], body, status=status)
        except Conflict:
            self.metrics.conflicts.inc()
            try:
                self.cache.jobs[key] = await asyncio.to_thread(self.kube.get, adapter.resource, key[1], key[2])
            except NotFound:
                self.cache.jobs.pop(key, None)
                return None
            self.requeue(key)
            return None
        except NotFound:
            self.cache.jobs.pop(key, None)
            return None
        self.cache.jobs[key] = new
        return new

    async def create_event(self, obj: Mapping[str, Any], involved: Resource, *, key: str, reason: str, message: str,
                           event_type: str, action: str) -> bool:
        """Posts the Event about `obj` (of resource `involved`); False when not the leader."""
        if not self.is_leader():
            return False
        body = event_body(obj, involved, key=key, reason=reason, message=message, event_type=event_type, action=action,
                          identity=self.identity, now=now())
        try:
            await asyncio.to_thread(self.kube.create, EVENTS, meta(obj).get("namespace", "default"), body)
        except Conflict:
            pass  # the same decision's Event exists already
        return True

    async def report_invalid(self, key: JobKey, obj: Mapping[str, Any], adapter: JobAdapter, exc: PolicyError) -> None:
        """A Warning Event naming the bad annotation (or pod template entry), once per distinct problem."""
        text = f"{exc.field}: {exc.message}"
        if self._reported_invalid.get(key) == text:
            return
        message = f"invalid policy {exc.setting} {exc.field}: {exc.message}; the job is left untouched"
        ok = await self.create_event(obj, adapter.resource, key=decision_key("invalid", meta(obj).get("uid", ""), text),
                                     reason=names.EVENT_INVALID_POLICY, message=message, event_type="Warning",
                                     action="Validate")
        if ok:
            self._reported_invalid[key] = text
        log.warning("job %s/%s: %s", key[1], key[2], message)

    def forget_invalid(self, key: JobKey) -> None:
        self._reported_invalid.pop(key, None)

    async def ensure_event(self, obj: Mapping[str, Any], adapter: JobAdapter, record: Record) -> None:
        if not record.key or record.key in self._evented:
            return
        event_type = "Warning" if record.event in WARNING_EVENTS else "Normal"
        if await self.create_event(obj, adapter.resource, key=record.key, reason=record.event or "SpotguardDecision",
                                   message=record.message, event_type=event_type, action=record.phase):
            self._remember(record.key)

    async def ensure_placement_event(self, obj: Mapping[str, Any], adapter: JobAdapter, record: Record) -> None:
        """The Event of the backfill's last placement (placer.py), once."""
        if not record.backfill_event or record.backfill_at is None:
            return
        key = decision_key("placement", meta(obj).get("uid", ""), format_time(record.backfill_at), record.backfill)
        if key in self._evented:
            return
        if await self.create_event(obj, adapter.resource, key=key, reason=record.backfill_event,
                                   message=record.backfill, event_type="Normal", action="Place"):
            self._remember(key)

    def _remember(self, key: str) -> None:
        self._evented.add(key)
        if len(self._evented) > 100000:
            self._evented.clear()

    async def ensure_conditions(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> dict | None:
        new_conditions = conditions.merged((obj.get("status") or {}).get("conditions"), record, now())
        if new_conditions is None:
            return obj
        return await self.write_job(key, adapter, conditional(obj, {"status": {"conditions": new_conditions}}),
                                    status=True)

    async def push_membership(self, namespace: str, push: MembershipPush) -> None:
        """Writes the membership annotation `push.value` on the pods it names (those whose value
        differs; a pod gone meanwhile is skipped)."""
        for name in push.pods:
            if not self.is_leader():
                return
            if not name:
                raise ValueError(f"a replica pod without metadata.name to tell membership {push.generation}")
            try:
                await asyncio.to_thread(self.kube.patch, PODS, namespace, name, membership.pod_patch(push.value))
            except NotFound:
                continue
