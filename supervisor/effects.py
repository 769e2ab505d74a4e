"""The controller's writes: the job's conditional patches and everything level-triggered that
follows a decision (Events, conditions, steps lost, membership and drain on the pods).

Contract:
- nothing is written unless `is_leader()`; every write of the job carries the cached object's
  `metadata.resourceVersion` as precondition (`conditional`): a 409 re-reads the job into the
  cache and requeues it (the reconciler decides again on the fresh object), a 404 drops it;
- the `ensure_*` methods are idempotent: each compares what is there with what the decision
  record implies and writes only the difference; a decision's Event is named after its
  idempotency key (409 AlreadyExists = posted before).
"""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Mapping

from spotguard.kube.api import EVENTS, PODS, Conflict, Kube, NotFound
from spotguard.supervisor import conditions, membership, placement, progress
from spotguard.wire import names
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, annotations_of, meta
from spotguard.supervisor.events import event_body
from spotguard.supervisor.in_place import (fresh_members, group_gone, held_for_replacement, in_place_group,
                                           joiners_settled, ready_joiners, start_members, starting_joiners)
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.policy import PolicyError, decision_key
from spotguard.supervisor.record import RUNNING, Record, RecordError, parse_record

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

    def __init__(self, kube: Kube, cache: ClusterCache, *, identity: str, membership_hosts: str,
                 metrics: SupervisorMetrics, is_leader: Callable[[], bool], requeue: Callable[..., None],
                 join_settle: float = 10.0):
        self.kube = kube
        self.cache = cache
        self.identity = identity
        self.membership_hosts = membership_hosts
        self.metrics = metrics
        self.is_leader = is_leader
        self.requeue = requeue
        self.join_settle = join_settle  # how long Ready joiners wait for replacements still starting
        self._ready_seen: dict[JobKey, dict[str, float]] = {}  # job -> Ready joiner pod uid -> first seen
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

    async def create_event(self, obj: Mapping[str, Any], *, key: str, reason: str, message: str, event_type: str,
                           action: str) -> bool:
        if not self.is_leader():
            return False
        body = event_body(obj, key=key, reason=reason, message=message, event_type=event_type, action=action,
                          identity=self.identity, now=now())
        try:
            await asyncio.to_thread(self.kube.create, EVENTS, meta(obj).get("namespace", "default"), body)
        except Conflict:
            pass  # the same decision's Event exists already
        return True

    async def report_invalid(self, key: JobKey, obj: Mapping[str, Any], exc: PolicyError) -> None:
        """A Warning Event naming the bad annotation, once per distinct problem."""
        text = f"{exc.field}: {exc.message}"
        if self._reported_invalid.get(key) == text:
            return
        message = f"invalid policy annotation {exc.field}: {exc.message}; the job is left untouched"
        ok = await self.create_event(obj, key=decision_key("invalid", meta(obj).get("uid", ""), text),
                                     reason=names.EVENT_INVALID_POLICY, message=message, event_type="Warning",
                                     action="Validate")
        if ok:
            self._reported_invalid[key] = text
        log.warning("job %s/%s: %s", key[1], key[2], message)

    def forget_invalid(self, key: JobKey) -> None:
        self._reported_invalid.pop(key, None)

    async def ensure_event(self, obj: Mapping[str, Any], record: Record) -> None:
        if not record.key or record.key in self._evented:
            return
        event_type = "Warning" if record.event in WARNING_EVENTS else "Normal"
        if await self.create_event(obj, key=record.key, reason=record.event or "SpotguardDecision",
                                   message=record.message, event_type=event_type, action=record.phase):
            self._evented.add(record.key)
            if len(self._evented) > 100000:
                self._evented.clear()

    async def ensure_conditions(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> dict | None:
        new_conditions = conditions.merged((obj.get("status") or {}).get("conditions"), record, now())
        if new_conditions is None:
            return obj
        return await self.write_job(key, adapter, conditional(obj, {"status": {"conditions": new_conditions}}),
                                    status=True)

    async def ensure_steps_lost(self, key: JobKey, obj: dict, adapter: JobAdapter) -> dict | None:
        """Adds the steps lost that newly drained pods report (their termination message) to the
        record and writes the total as `spotguard.io/steps-lost`."""
        annotations = annotations_of(obj)
        try:
            record = parse_record(annotations.get(names.ANN_STATUS))
        except RecordError:
            return obj
        counted = progress.count_steps_lost(self.cache.pods_of(key), record.steps_lost, record.counted_exits)
        if counted is None and (record.decided_at is None or annotations.get(names.ANN_STEPS_LOST) is not None):
            return obj
        total, exits = counted or (record.steps_lost, record.counted_exits)
        body = record_patch(obj, record.with_(steps_lost=total, counted_exits=exits),
                            **{names.ANN_STEPS_LOST: str(total)})
        return await self.write_job(key, adapter, body)

    async def ensure_membership(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record,
                                in_place: bool = False, start_at_min: int = 0, limit: int | None = None,
                                standby: bool = False) -> None:
        """Elastic jobs the supervisor has acted on: pushes the hosts of the running replicas on
        nodes without a notice (new generation when they or the store change) to every active
        replica pod. `in_place`: members, their stable order and the store follow in_place.py,
        at most `limit` (max-replicas) hosts, a joiner beyond it taking an on-demand member's
        place (the swap-back, placement.py). `start_at_min` (min-replicas of an in-place
        start-at-min job, 0: not one): the first group is pushed, acted on or not, once that many
        pods are Ready (in_place.py `start_members`). `standby` (in place, a backfill job with a
        spare): the memberships say so, and a member on a noticed node stays listed while a
        replacement is on its way (in_place.py `held_for_replacement`)."""
        if record.phase != RUNNING or adapter.suspended(obj):
            return
        if start_at_min and in_place:
            pods = self.cache.replica_pods(key, adapter)
            if not record.members or group_gone(pods, record.member_pods):
                await self._push_start_group(key, obj, adapter, record, pods, start_at_min, limit, standby)
                return
        elif record.decided_at is None:
            return
        incarnations: tuple[str, ...] = ()
        if in_place:
            pods = self.cache.replica_pods(key, adapter)
            if group_gone(pods, record.member_pods):
                await self._push_fresh_group(key, obj, adapter, record, pods, standby)
                return
            admit = self._joiners_settled(key, pods, record.members)
            member_node: Callable[[Mapping[str, Any]], bool] = self.cache.on_healthy_node
            if standby:
                member_node = held_for_replacement(pods, record.members, self.membership_hosts, member_node,
                                                   self.cache.on_noticed_node, admit)
            hosts, store, incarnations = in_place_group(pods, record.members, self.membership_hosts,
                                                        member_node, admit, limit,
                                                        self._on_demand_hosts(pods, adapter, obj))
            if hosts and not store:
                return  # the first host's pod has no IP yet: its update requeues the job
            replicas = len(hosts)
        else:
            pods, hosts, members = self.cache.members(key, adapter, self.membership_hosts)
            store = ""
            replicas = len(hosts) if self.membership_hosts == "node" else len(members)
        if not hosts:
            return
        if hosts != record.members or store != record.store:
            record = record.with_(generation=record.generation + 1, members=hosts, store=store,
                                  member_pods=incarnations)
            if await self.write_job(key, adapter, record_patch(obj, record)) is None:
                return
        elif incarnations and not record.member_pods:  # a record from before member_pods: learn them
            record = record.with_(member_pods=incarnations)
            if await self.write_job(key, adapter, record_patch(obj, record)) is None:
                return
        world = replicas * membership.processes_per_replica(adapter.pod_spec(obj))
        start = in_place and record.generation == record.start_generation > 0  # the first group, told again
        await self._push_membership(pods, membership.membership_json(record.generation, hosts, world, store=store,
                                                                     start=start, standby=standby))

    async def _push_fresh_group(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record,
                                pods: list[dict], standby: bool = False) -> None:
        """The in-place group of the last membership is gone (in_place.py `group_gone`): nothing
        stale is pushed; once every replica pod of the relaunched job runs, its own group is, as
        a new generation (hosts in completion-index order, the lowest index's store)."""
        fresh = fresh_members(pods, adapter.replicas(obj), self.membership_hosts)
        if fresh is None:
            return  # the relaunched pods' updates requeue the job
        hosts, store, incarnations = fresh
        record = record.with_(generation=record.generation + 1, members=hosts, store=store, member_pods=incarnations)
        log.info("job %s/%s: every member of the in-place group is gone; membership %d is the relaunched group "
                 "(%s, store %s)", key[1], key[2], record.generation, ", ".join(hosts), store)
        if await self.write_job(key, adapter, record_patch(obj, record)) is None:
            return
        world = len(hosts) * membership.processes_per_replica(adapter.pod_spec(obj))
        await self._push_membership(pods, membership.membership_json(record.generation, hosts, world, store=store,
                                                                     standby=standby))

    async def _push_start_group(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record,
                                pods: list[dict], least: int, limit: int | None, standby: bool = False) -> None:
        """A start-at-min job without a running group: once `least` pods are Ready, their first
        membership (marked `start`, at most `limit` hosts), as a new generation."""
        found = start_members(pods, least, self.membership_hosts, self.cache.on_healthy_node, limit)
        if found is None:
            return  # the pods' updates requeue the job
        hosts, store, incarnations = found
        record = record.with_(generation=record.generation + 1, members=hosts, store=store, member_pods=incarnations,
                              start_generation=record.generation + 1)
        log.info("job %s/%s: %d of min %d pods Ready; membership %d starts the group (%s, store %s)", key[1], key[2],
                 len(hosts), least, record.generation, ", ".join(hosts), store)
        if await self.write_job(key, adapter, record_patch(obj, record)) is None:
            return
        world = len(hosts) * membership.processes_per_replica(adapter.pod_spec(obj))
        await self._push_membership(pods, membership.membership_json(record.generation, hosts, world, store=store,
                                                                     start=True, standby=standby))

    def _on_demand_hosts(self, pods: list[dict], adapter: JobAdapter, obj: Mapping[str, Any]) -> frozenset[str]:
        """Hosts of the replica pods the backfill placed on on-demand capacity (placement.py)."""
        label = placement.capacity_label(adapter.pod_spec(obj))
        if label is None:
            return frozenset()
        return frozenset(membership.host_of(p, self.membership_hosts) for p in pods
                         if placement.placed_on(p, label) == placement.ON_DEMAND)

    def _joiners_settled(self, key: JobKey, pods: list[dict], previous: tuple[str, ...]) -> bool:
        """Whether the job's Ready joiners are admitted now (in_place.py `joiners_settled`: all
        at once, unless another replacement is still starting and `join_settle` has not passed
        since the first was seen Ready; then the job is requeued for that moment)."""
        ready = ready_joiners(pods, previous, self.membership_hosts, self.cache.on_healthy_node)
        now = time.monotonic()
        earlier = self._ready_seen.get(key, {})
        seen = {uid: earlier.get(uid, now) for uid in (meta(p).get("uid") or meta(p).get("name", "") for p in ready)}
        if seen:
            self._ready_seen[key] = seen
        else:
            self._ready_seen.pop(key, None)
        ready_for = [now - t for t in seen.values()]
        starting = starting_joiners(pods, previous, self.membership_hosts, self.cache.on_healthy_node)
        if joiners_settled(ready_for, len(starting), self.join_settle):
            return True
        self.requeue(key, self.join_settle - max(ready_for) + 0.05)
        return False

    async def ensure_drain(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> None:
        """A return to spot under way: the drain request rides the membership annotation to every
        active replica pod (sidecar -> Guard: a `drain` notice, checkpoint, exit 83)."""
        pods, hosts, members = self.cache.members(key, adapter, self.membership_hosts)
        count = len(members)
        if record.store:  # in place: the group's own hosts and store, so only the drain is new
            hosts, count = record.members, len(record.members)
        world = count * membership.processes_per_replica(adapter.pod_spec(obj))
        await self._push_membership(pods, membership.membership_json(record.generation, hosts, world,
                                                                     drain=record.drain, store=record.store))

    async def _push_membership(self, pods: list[dict], value: str) -> None:
        for pod in membership.pods_to_update(pods, value):
            if not self.is_leader():
                return
            name = meta(pod).get("name")
            if not name:
                raise ValueError(f"a replica pod without metadata.name: {meta(pod)!r}")
            try:
                await asyncio.to_thread(self.kube.patch, PODS, meta(pod).get("namespace"), name,
                                        membership.pod_patch(value))
            except NotFound:
                continue
