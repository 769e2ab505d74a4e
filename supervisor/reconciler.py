"""One reconcile pass over one job: job -> state -> decide -> one conditional patch -> effects.

Contract of `Reconciler.reconcile(key)` (leader only; a finished or unknown job is skipped):
validate the policy and, for the fallback, that the pod template tells spot from on-demand
(invalid -> one Warning Event naming the annotation, the job is not written to); reduce the
cache to a `JobState` (`job_state`); `policy.decide`; apply the decision as ONE merge patch
of the job that carries the spec change, the new decision record (notices handled, idempotency
key, cost totals, and for a scale the new membership) and `metadata.resourceVersion` as
precondition (409 -> re-read, decide again); then, level-triggered and idempotent, the
effects (`JobEffects`): the decision's Event, the job's conditions, the steps lost, and the
membership (elastic) or drain request (a return to spot) on the job's pods, and for a backfill
job the placement of its gated pods (placer.py). A decision with `recheck_at` requeues the job
then.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import datetime
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from spotguard.wire.notice import Kind
from spotguard.supervisor import capacity, progress
from spotguard.wire import names
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, annotations_of
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.disruption import disrupted, disruption_hits
from spotguard.supervisor.effects import JobEffects, conditional, now
from spotguard.supervisor.fallback import ON_DEMAND, on_demand_directives
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.jobs.base import merge
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.placer import Placer
from spotguard.supervisor.policy import (ELASTIC, MOVE, RESUME, SCALE, SUSPEND, Decision, JobState, NoticeHit,
                                         Policy, PolicyError, Settings, check_spare, check_template, decide,
                                         needs_capacity, parse_policy)
from spotguard.supervisor.record import CHECKPOINTING, Record, RecordError, parse_record

log = logging.getLogger(__name__)

NON_ACTING_KINDS = (Kind.REBALANCE.value,)  # a rebalance is a risk, not a departure


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
        self.placer = Placer(cache, effects)

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
            policy = parse_policy(annotations, adapter.default_max(obj), adapter.default_min(obj))
            check_template(policy, adapter.directives(obj), record)
            check_spare(policy, adapter.replicas(obj), self.placer.wants(policy, obj, adapter))
        except PolicyError as exc:
            await self.effects.report_invalid(key, obj, exc)
            return None
        self.effects.forget_invalid(key)
        decision = self._decide(key, obj, adapter, policy, record)
        if decision.acts:
            applied = await self._apply(key, obj, adapter, decision)
            if applied is None:
                return None
            if set(decision.record.handled) - set(record.handled):
                self._observe_latency(key)
            obj, record = applied, decision.record
        if decision.recheck_at is not None:
            self.requeue(key, max(0.05, (decision.recheck_at - now()).total_seconds() + 0.01))
        await self._effects(key, obj, adapter, policy, record)
        return decision

    def _decide(self, key: JobKey, obj: dict, adapter: JobAdapter, policy: Policy, record: Record) -> Decision:
        decision = decide(self.job_state(key, obj, adapter, policy, record), now(), self.settings, self.identity)
        if decision.acts and key in self.ledger.jobs:  # the cost totals travel with every decision
            decision = replace(decision, record=decision.record.with_(cost=self.ledger.jobs[key].totals()))
        if decision.action == SCALE and not policy.in_place:  # the new membership travels with it: one write less
            hosts = self.cache.members(key, adapter, self.membership_hosts)[1]
            if hosts and hosts != decision.record.members:
                decision = replace(decision, record=decision.record.with_(
                    generation=decision.record.generation + 1, members=hosts))
        return decision

    async def _effects(self, key: JobKey, obj: dict, adapter: JobAdapter, policy: Policy, record: Record) -> None:
        await self.effects.ensure_event(obj, record)
        current = await self.effects.ensure_conditions(key, obj, adapter, record)
        if current is not None:
            current = await self.effects.ensure_steps_lost(key, current, adapter)
        if current is not None and policy.mode == ELASTIC:
            standby = (self.placer.wants(policy, current, adapter)  # a spare: the warm standby places it at a notice
                       and adapter.replicas(current) > policy.max_replicas)
            await self.effects.ensure_membership(key, current, adapter, record, in_place=policy.in_place,
                                                 start_at_min=policy.min_replicas if policy.start_at_min else 0,
                                                 limit=policy.max_replicas, standby=standby)
        if current is not None and self.placer.wants(policy, current, adapter):
            recheck = await self.placer.ensure(key, current, adapter, policy, record)
            if recheck is not None:
                self.requeue(key, max(0.05, (recheck - now()).total_seconds() + 0.01))
        if current is not None and record.drain and record.phase == CHECKPOINTING:
            await self.effects.ensure_drain(key, current, adapter, record)

    async def _apply(self, key: JobKey, obj: dict, adapter: JobAdapter, decision: Decision) -> dict | None:
        """Writes the decision as one conditional patch; None when it must be re-decided."""
        if decision.action == SCALE:
            if decision.replicas is None:
                raise RuntimeError(f"job {key[1]}/{key[2]}: a {SCALE} decision without replicas")
            body = adapter.scale_patch(decision.replicas)
        elif decision.action == SUSPEND:
            body = adapter.suspend_patch(True)
        elif decision.action == RESUME:
            body = adapter.suspend_patch(False, decision.replicas)
        elif decision.action == MOVE:
            body = merge(adapter.suspend_patch(False, decision.replicas),
                         adapter.directives_patch(obj, decision.directives or {}))
        else:
            body = {}
        status = {"metadata": {"annotations": {names.ANN_STATUS: decision.record.to_json()}}}
        body = merge(body, conditional(obj, status))
        new = await self.effects.write_job(key, adapter, body)
        if new is None:
            return None
        self.metrics.decisions.inc(action=decision.action, reason=decision.reason)
        log.info("job %s/%s: %s", key[1], key[2], decision.message,
                 extra={"action": decision.action, "replicas": decision.replicas, "key": decision.key})
        return new

    def _observe_latency(self, key: JobKey) -> None:
        seen = self.cache.notice_seen_at(key)
        if seen is not None:
            self.metrics.notice_to_patch.observe(time.monotonic() - seen)

    # ---- state reduction (pure reads of the cache) -----------------------------------------
    def job_state(self, key: JobKey, obj: Mapping[str, Any], adapter: JobAdapter, policy, record: Record) -> JobState:
        """What `decide` needs of the job, from the cache."""
        all_pods = self.cache.pods_of(key)
        replicas = [p for p in all_pods if capacity.pod_active(p) and adapter.is_replica_pod(p)]
        hits: list[NoticeHit] = []
        healthy = 0
        hits += disruption_hits(all_pods, adapter.is_replica_pod)  # preempted / evicted pods (disruption.py)
        for pod in replicas:
            node_name = (pod.get("spec") or {}).get("nodeName")
            if not node_name or disrupted(pod):
                continue
            node = self.cache.nodes.get(node_name)
            notice = self.cache.node_notice(node)
            if node is not None and capacity.has_notice(node):
                if notice is not None and notice.kind.value not in NON_ACTING_KINDS:
                    hits.append(NoticeHit(notice.id, node_name, notice.kind.value, notice.deadline))
                elif notice is None or notice.kind.value in NON_ACTING_KINDS:
                    healthy += 1  # a rebalance recommendation (or a taint without notice) departs nobody
                continue
            if node is not None:
                healthy += 1
        unique_hits = tuple({h.id: h for h in hits}.values())
        replicas_now = adapter.replicas(obj)
        suspended = adapter.suspended(obj)
        free = alt = 0
        directives = adapter.directives(obj) if policy.fallback is not None or record.move_to else {}
        if needs_capacity(policy, record, replicas_now, suspended):
            free = self.cache.free_slots(key, adapter.pod_spec(obj), ignore_own=suspended)
            alt_spec = _alternative_pod_spec(adapter, obj, directives, record)
            if alt_spec is not None:
                alt = self.cache.free_slots(key, alt_spec, ignore_own=True)
        drained = record.phase == CHECKPOINTING and _drained(all_pods, self._checkpoint_since(all_pods, record))
        # A template change reaches only pods created after it: the old pods must be gone first,
        # or a job resumed before its controller saw the suspension keeps them (a PyTorchJob's
        # operator reconciles the latest state, and a move follows the suspension in milliseconds).
        old_pods_gone = not any(capacity.pod_active(p) for p in all_pods)
        return JobState(policy=policy, replicas=replicas_now, suspended=suspended, record=record,
                        notices=unique_hits, healthy_replicas=healthy, free_slots=free, drained=drained,
                        directives=directives, alt_slots=alt,
                        template_mutable=adapter.template_mutable(obj) and old_pods_gone)

    def _checkpoint_since(self, pods: Iterable[Mapping[str, Any]], record: Record) -> datetime | None:
        """When the notices being checkpointed began: the earliest detection of a handled notice
        still on one of the job's nodes, else the supervisor's decision time."""
        times = [record.decided_at] if record.decided_at is not None else []
        for pod in pods:
            notice = self.cache.node_notice(self.cache.nodes.get((pod.get("spec") or {}).get("nodeName") or ""))
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
