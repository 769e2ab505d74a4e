"""Keeps the jobs' cost totals: observed from the cache, restored from and saved into each job's
decision record, and exported as metrics.

Contract: `restore(key, obj)` seeds a job's totals from its record once (a restarted supervisor
continues them); `observe(keys)` integrates the node-hours of those jobs (default: every job) up
to now, and the controller calls it for a job at each change of its pods or nodes, so a stint
on a capacity type is counted however short; `save()` writes the totals into a record whose
saved totals differ (leader only, through `JobEffects.write_job`), never into a job whose policy
annotations are invalid (the supervisor does not write to such a job at all); `collect()`
refreshes the metric families before a scrape. A job runs on on-demand capacity
(`spotguard_job_on_demand`) after a fallback (the record's `capacity`) and while one of a
backfill job's replicas runs where the supervisor placed it on on-demand (placement.py): the
jobs that use on-demand the most are backfill jobs, and the alert on 2 h of it reads this gauge.
"""
from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Callable, Iterable, Mapping

from spotguard.kube.api import ApiError
from spotguard.wire import names
from spotguard.supervisor import placement
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, annotations_of
from spotguard.supervisor.capacity_type import ON_DEMAND
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.effects import JobEffects, record_patch
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.policy import PolicyError, parse_policy
from spotguard.supervisor.record import GAVE_UP, SUSPENDED, RecordError, parse_record

log = logging.getLogger(__name__)


def valid_policy(obj: Mapping[str, Any], adapter: JobAdapter) -> bool:
    """Whether the job's policy annotations parse (the reconciler's own test)."""
    try:
        parse_policy(annotations_of(obj), adapter.default_max(obj), adapter.default_min(obj),
                     adapter.role_pod_specs(obj))
    except PolicyError:
        return False
    return True


class CostKeeper:
    """See the module docstring."""

    def __init__(self, ledger: CostLedger, cache: ClusterCache, adapters: Mapping[str, JobAdapter],
                 effects: JobEffects, metrics: SupervisorMetrics, is_leader: Callable[[], bool]):
        self.ledger = ledger
        self.cache = cache
        self.adapters = adapters
        self.effects = effects
        self.metrics = metrics
        self.is_leader = is_leader

    def restore(self, key: JobKey, obj: Mapping[str, Any]) -> None:
        if key in self.ledger.jobs:
            return
        try:
            record = parse_record(annotations_of(obj).get(names.ANN_STATUS))
        except RecordError:
            return
        self.ledger.restore(key, record.cost)

    def forget(self, key: JobKey) -> None:
        self.ledger.forget(key)

    def observe(self, keys: Iterable[JobKey] | None = None) -> None:
        now = time.monotonic()
        for key in list(self.cache.jobs) if keys is None else [k for k in keys if k in self.cache.jobs]:
            adapter = self.adapters.get(key[0])
            if adapter is not None:
                self.ledger.observe(key, self.cache.running_nodes(key, adapter), now)

    async def save(self) -> None:
        """Writes each job's cost totals into its decision record when they changed (leader only)."""
        for key, obj in list(self.cache.jobs.items()):
            entry, adapter = self.ledger.jobs.get(key), self.adapters.get(key[0])
            if entry is None or adapter is None or not self.is_leader() or not valid_policy(obj, adapter):
                continue
            try:
                record = parse_record(annotations_of(obj).get(names.ANN_STATUS))
            except RecordError:
                continue
            totals = entry.totals()
            if (record.decided_at is None and not totals["cost"] and not totals["spot_hours"] \
                    and not totals["on_demand_hours"]) or record.cost == totals:
                continue
            try:
                await self.effects.write_job(key, adapter, record_patch(obj, record.with_(cost=totals)))
            except ApiError as exc:
                log.warning("saving the cost of %s/%s failed: %s", key[1], key[2], exc)

    def _backfill_on_demand(self, key: JobKey, obj: Mapping[str, Any]) -> bool:
        adapter = self.adapters.get(key[0])
        if adapter is None:
            return False
        return placement.running_on_demand(self.cache.replica_pods(key, adapter), adapter.pod_spec(obj)) > 0

    def collect(self) -> None:
        self.observe()
        m = self.metrics
        for family in (m.cost, m.on_demand, m.savings, m.spot_hours, m.on_demand_hours, m.reclaims, m.steps_lost,
                       m.suspended, m.on_demand_now):
            family.clear()
        m.managed_jobs.set(len(self.cache.jobs))
        m.leader.set(1 if self.is_leader() else 0)
        for key, obj in self.cache.jobs.items():
            labels = {"kind": key[0], "namespace": key[1], "job": key[2]}
            entry = self.ledger.jobs.get(key)
            if entry is not None:
                m.cost.set(entry.cost, **labels)
                m.on_demand.set(entry.on_demand_equivalent, **labels)
                m.savings.set(entry.savings_ratio, **labels)
                m.spot_hours.set(entry.spot_hours, **labels)
                m.on_demand_hours.set(entry.on_demand_hours, **labels)
            annotations = annotations_of(obj)
            try:
                record = parse_record(annotations.get(names.ANN_STATUS))
            except RecordError:
                record = None
            if record is not None:
                m.reclaims.set(record.reclaims_survived, **labels)
                m.suspended.set(1 if record.phase in (SUSPENDED, GAVE_UP) else 0, **labels)
                m.on_demand_now.set(1 if record.capacity == ON_DEMAND or self._backfill_on_demand(key, obj) else 0,
                                    **labels)
            lost = str(annotations.get(names.ANN_STEPS_LOST, "")).strip()
            if lost.isdigit():
                m.steps_lost.set(int(lost), **labels)
