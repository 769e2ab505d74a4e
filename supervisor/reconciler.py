"""One reconcile pass over one job: job -> state -> decide -> one conditional patch -> follow-ups.

Contract of `Reconciler.reconcile(key)` (leader only; a finished or unknown job is skipped):
validate the policy and, for the fallback, that the pod template tells spot from on-demand
(invalid -> one Warning Event naming the annotation, the job is not written to); reduce the
cache to a `JobState` (`job_state`: the notices read through job_notices.py, the job's pods for
its membership); `policy.decide`, which returns the action, the whole new record (membership,
steps lost included) and the membership to push; a backfill job's placement adds its record
fields (placer.py). Then at most ONE patch of the job: the spec change, the record, the steps-lost
annotation and `metadata.resourceVersion` as precondition (409 -> re-read, decide again); a pass
that changes nothing writes nothing. After it, level-triggered and idempotent: the decision's
Event, the job's conditions (the status subresource, a separate endpoint, written only when they
change), the membership on the pods, the placement of gated pods and its Event. A decision with `recheck_at`
requeues the job then.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import datetime
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from spotguard.supervisor import capacity, membership, placement, progress
from spotguard.wire import names
from spotguard.wire.notice import Notice
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, annotations_of
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.decision import MOVE, RESUME, SCALE, SUSPEND, Decision, JobState, Policy, Settings, earliest
from spotguard.supervisor.effects import JobEffects, conditional, now
from spotguard.supervisor.fallback import ON_DEMAND, on_demand_directives
from spotguard.supervisor.job_notices import NoticeHit, read_job
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.jobs.base import merge
from spotguard.supervisor.membership_plan import JobPods
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.placer import Placer, Placing
from spotguard.supervisor.policy import PolicyError, check_spare, check_template, decide, needs_capacity, parse_policy
from spotguard.supervisor.record import CHECKPOINTING, Record, RecordError, parse_record

log = logging.getLogger(__name__)


class Reconciler:
    """See the module docstring."""

    def __init__(self, cache: ClusterCache, effects: JobEffects, adapters: Mapping[str, JobAdapter], *,
                 settings: Settings, identity: str, membership_hosts: str, ledger: CostLedger,
                 metrics: SupervisorMetrics, is_leader: Callable[[], bool], requeue: Callable[[JobKey, float], None]):
        self.cache = cache
        self.effects = effects
        self.adapters = adapters
        self.settings = settings
        self.identity = identity
        self.membership_hosts = membership_hosts
        self.ledger = ledger
        self.metrics = metrics
        self.is_leader = is_leader
        self.requeue = requeue
        self.placer = Placer(cache, effects, membership_hosts)

    async def reconcile(self, key: JobKey) -> Decision | None:
        """One pass over one job (see the module docstring). Returns the decision taken."""
        obj = self.cache.jobs.get(key)
        adapter = self.adapters.get(key[0])
        if obj is None or adapter is None or adapter.finished(obj) or not self.is_leader():
            return None
        annotations = annotations_of(obj)
        try:
            record = parse_record(annotations.get(names.ANN_STATUS))
        except RecordError as exc:
            log.warning("job %s/%s: unreadable %s (%s); starting a fresh record", key[1], key[2], names.ANN_STATUS, exc)
            record = Record()
        try:
            policy = parse_policy(annotations, adapter.default_max(obj), adapter.default_min(obj),
                                  adapter.role_pod_specs(obj))
            check_template(policy, adapter.directives(obj), record)
            check_spare(policy, adapter.replicas(obj), self.placer.wants(policy, obj, adapter))
        except PolicyError as exc:
            await self.effects.report_invalid(key, obj, adapter, exc)
            return None
        self.effects.forget_invalid(key)
        at = now()
        state = self.job_state(key, obj, adapter, policy, record, at)
        decision = decide(state, at, self.settings, self.identity)
        if decision.acts and key in self.ledger.jobs:  # the cost totals travel with every decision
            decision = replace(decision, record=decision.record.with_(cost=self.ledger.jobs[key].totals()))
        placing = None
        if self.placer.wants(policy, obj, adapter):
            stopping = state.suspended or decision.action == SUSPEND  # its controller deletes the pods
            placed, placing = self.placer.plan(key, obj, adapter, policy, decision.record,
                                               state.pods.departing if state.pods else (), at,
                                               () if stopping else record.member_pods)
            decision = replace(decision, record=placed)
        written = await self._write(key, obj, adapter, decision, record)
        if written is None:
            return None
        handled = set(decision.record.handled) - set(record.handled)
        if handled:
            self._observe_latency(key, [h for h in state.notices if h.id in handled])
        await self._follow_up(key, written, adapter, decision, placing)
        return decision

    async def _write(self, key: JobKey, obj: dict, adapter: JobAdapter, decision: Decision,
                     record: Record) -> dict | None:
        """The pass's one conditional patch of the job (none when nothing changes): the new object,
        or None when it must be re-decided."""
        body = _patch_body(obj, adapter, decision, record)
        if not body:
            return obj
        new = await self.effects.write_job(key, adapter, conditional(obj, body))
        if new is None:
            return None
        if decision.acts:
            self.metrics.decisions.inc(action=decision.action, reason=decision.reason)
            log.info("job %s/%s: %s", key[1], key[2], decision.message,
                     extra={"action": decision.action, "replicas": decision.replicas, "key": decision.key})
        push = decision.membership
        if push is not None and push.why:
            log.info("job %s/%s: membership %d (%s): %s", key[1], key[2], push.generation, push.why,
                     ", ".join(push.hosts))
        return new

    async def _follow_up(self, key: JobKey, obj: dict, adapter: JobAdapter, decision: Decision,
                         placing: Placing | None) -> None:
        """What follows the write: requeue, Event, conditions, membership, placement and its Event."""
        recheck = earliest(decision.recheck_at, placing.recheck_at if placing else None)
        if recheck is not None:
            self.requeue(key, max(0.05, (recheck - now()).total_seconds() + 0.01))
        await self.effects.ensure_event(obj, adapter, decision.record)
        await self.effects.ensure_conditions(key, obj, adapter, decision.record)
        if decision.membership is not None:
            await self.effects.push_membership(key[1], decision.membership)
        if placing is not None:
            await self.placer.apply(key, placing)
        await self.effects.ensure_placement_event(obj, adapter, decision.record)

    def _observe_latency(self, key: JobKey, hits: Iterable[NoticeHit]) -> None:
        """Notice seen -> the job patched; for notices held beyond the horizon, from their release."""
        seen = self.cache.notice_seen_at(key)
        if seen is None:
            return
        latency = time.monotonic() - seen
        releases = [h.released_at for h in hits if h.released_at is not None]
        if releases:
            latency = min(latency, max(0.0, (now() - max(releases)).total_seconds()))
        self.metrics.notice_to_patch.observe(latency)

    # ---- state reduction (pure reads of the cache) -----------------------------------------
    def job_state(self, key: JobKey, obj: Mapping[str, Any], adapter: JobAdapter, policy: Policy, record: Record,
                  at: datetime | None = None) -> JobState:
        """What `decide` needs of the job at `at` (default now), from the cache."""
        at = at or now()
        every = self.cache.pods_of(key)
        notices = self._notices(every, record)
        reading = read_job(every, adapter.is_replica_pod, notices, at, policy.horizon_seconds)
        replicas_now = adapter.replicas(obj)
        suspended = adapter.suspended(obj)
        free = alt = 0
        directives = adapter.directives(obj) if policy.fallback is not None or record.move_to else {}
        if needs_capacity(policy, record, replicas_now, suspended):
            free = self.cache.free_slots(key, adapter.pod_spec(obj), ignore_own=suspended)
            alt_spec = _alternative_pod_spec(adapter, obj, directives, record)
            if alt_spec is not None:
                alt = self.cache.free_slots(key, alt_spec, ignore_own=True)
        drained = record.phase == CHECKPOINTING and _drained(every, _checkpoint_since(every, notices, record))
        # A template change reaches only pods created after it: the old pods must be gone first,
        # or a job resumed before its controller saw the suspension keeps them (a PyTorchJob's
        # operator reconciles the latest state, and a move follows the suspension in milliseconds).
        old_pods_gone = not any(capacity.pod_active(p) for p in every)
        return JobState(policy=policy, replicas=replicas_now, suspended=suspended, record=record,
                        notices=reading.hits, healthy_replicas=reading.healthy, free_slots=free, drained=drained,
                        directives=directives, alt_slots=alt,
                        template_mutable=adapter.template_mutable(obj) and old_pods_gone,
                        release_at=reading.release_at,
                        pods=self._job_pods(obj, adapter, policy, every, frozenset(notices), reading.departing))

    def _notices(self, pods: Iterable[Mapping[str, Any]], record: Record) -> dict[str, Notice | None]:
        """Known node -> its notice (None: none readable), for the nodes of the job's pods and of
        the notices its checkpoint waits for."""
        wanted = {(p.get("spec") or {}).get("nodeName") or "" for p in pods} | set((record.awaiting or {}).values())
        return {n: self.cache.node_notice(self.cache.nodes[n]) for n in wanted if n in self.cache.nodes}

    def _job_pods(self, obj: Mapping[str, Any], adapter: JobAdapter, policy: Policy, every: list[dict],
                  nodes: frozenset[str], departing: frozenset[str]) -> JobPods:
        spec = adapter.pod_spec(obj)
        replicas = tuple(p for p in every if capacity.pod_active(p) and adapter.is_replica_pod(p))
        standby = self.placer.wants(policy, obj, adapter) and adapter.replicas(obj) > policy.max_replicas
        return JobPods(replicas=replicas, every=tuple(every), nodes=nodes, departing=departing,
                       hosts_mode=self.membership_hosts, per_replica=membership.processes_per_replica(spec),
                       on_demand_hosts=placement.on_demand_hosts(replicas, spec, self.membership_hosts),
                       standby=standby)


def _patch_body(obj: Mapping[str, Any], adapter: JobAdapter, decision: Decision, record: Record) -> dict:
    """The merge patch of `decision` over the job as it is (`record` its record now): the spec
    change of the action, the record when it changed, the steps-lost annotation when it differs;
    {} when there is nothing to write."""
    if decision.action in (SCALE, RESUME, MOVE) and decision.replicas is None:
        raise RuntimeError(f"a {decision.action} decision without replicas: {decision.message}")
    body: dict = {}
    if decision.action == SCALE:
        body = adapter.scale_patch(decision.replicas or 0)
    elif decision.action == SUSPEND:
        body = adapter.suspend_patch(True)
    elif decision.action == RESUME:
        body = adapter.suspend_patch(False, decision.replicas)
    elif decision.action == MOVE:
        body = merge(adapter.suspend_patch(False, decision.replicas),
                     adapter.directives_patch(obj, decision.directives or {}))
    annotations: dict[str, str] = {}
    if decision.record != record:
        annotations[names.ANN_STATUS] = decision.record.to_json()
    steps = progress.steps_lost_annotation(decision.record)
    if steps is not None and annotations_of(obj).get(names.ANN_STEPS_LOST) != steps:
        annotations[names.ANN_STEPS_LOST] = steps
    if annotations:
        body = merge(body, {"metadata": {"annotations": annotations}})
    return body


def _checkpoint_since(pods: Iterable[Mapping[str, Any]], notices: Mapping[str, Notice | None],
                      record: Record) -> datetime | None:
    """When the notices being checkpointed began: the earliest detection of a handled notice
    still on one of the job's nodes, else the supervisor's decision time."""
    times = [record.decided_at] if record.decided_at is not None else []
    for pod in pods:
        notice = notices.get((pod.get("spec") or {}).get("nodeName") or "")
        if notice is not None and notice.id in record.handled:
            times.append(notice.detected_at)
    return min(times) if times else None


def _drained(pods: Iterable[Mapping[str, Any]], since: datetime | None) -> bool:
    """Whether a container exited 83/84 (in `state` or `lastState`) at or after `since`:
    an older drain (restartPolicy OnFailure keeps it in lastState) belongs to an earlier
    notice, and an exit without finishedAt cannot be told from one (progress.drained_exits)."""
    return any(True for _ in progress.drained_exits(pods, since))


def _alternative_pod_spec(adapter: JobAdapter, obj: Mapping[str, Any], directives: Mapping[str, Mapping],
                          record: Record) -> dict | None:
    """The replica pod spec on the other capacity: on-demand while on spot, the saved spot
    directives while on on-demand (fallback.py); None when there is none."""
    if not directives:
        return None
    other = record.spot_directives if record.capacity == ON_DEMAND else on_demand_directives(directives)
    wanted = (other or {}).get(adapter.replica_role)
    return None if wanted is None else {**adapter.pod_spec(obj), **wanted}
