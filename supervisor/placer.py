"""The placement pass of a backfill job (an elastic in-place job with `spotguard.io/fallback:
on-demand` whose pod template carries the `spotguard.io/capacity` gate; placement.py): reads the
job's replica pods and the free spot / on-demand slots from the cache, asks `placement.place`,
patches each chosen pod (nodeSelector key added, gate removed), and writes the record's
backfill fields (clocks, split, last placement) with the job's resourceVersion precondition
when they changed. Level-triggered and idempotent: a placed pod is no longer gated, so a pass
repeated after a restart places nothing twice. Returns when to look again (the fallback-after
or return-after clock), or None.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any
from collections.abc import Mapping

from spotguard.kube.api import PODS, NotFound
from spotguard.supervisor import capacity, membership, placement
from spotguard.supervisor.backfill import BackfillClocks, BackfillSettings
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, meta
from spotguard.supervisor.effects import JobEffects, now, record_patch
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.policy import Policy
from spotguard.supervisor.record import Record

log = logging.getLogger(__name__)
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
INDEX_LABELS = ("batch.kubernetes.io/job-completion-index", "training.kubeflow.org/replica-index")


def pod_index(pod: Mapping[str, Any]) -> int:
    """The pod's completion / replica index (0 when it has none)."""
    m = meta(pod)
    labels = m.get("labels") or {}
    found = [(m.get("annotations") or {}).get(INDEX_ANNOTATION)] + [labels.get(k) for k in INDEX_LABELS]
    raw = str(next((v for v in found if v), ""))
    return int(raw) if raw.isdigit() else 0


class Placer:
    """See the module docstring."""

    def __init__(self, cache: ClusterCache, effects: JobEffects):
        self.cache = cache
        self.effects = effects

    def wants(self, policy: Policy, obj: Mapping[str, Any], adapter: JobAdapter) -> bool:
        """Whether the job places its own pods: in place, the fallback on, its template gated."""
        spec = adapter.pod_spec(obj)
        return (policy.in_place and policy.fallback is not None
                and any(g.get("name") == placement.GATE for g in spec.get("schedulingGates") or []))

    async def ensure(self, key: JobKey, obj: dict, adapter: JobAdapter, policy: Policy,
                     record: Record) -> datetime | None:
        spec = adapter.pod_spec(obj)
        label = placement.capacity_label(spec)
        if label is None or policy.fallback is None:
            return None
        pods = self.cache.replica_pods(key, adapter)
        facts = [pod_facts(p, label, self.cache.nodes.get((p.get("spec") or {}).get("nodeName") or ""),
                           record.members, self.effects.membership_hosts) for p in pods]
        spot_spec = {**spec, "nodeSelector": {**(spec.get("nodeSelector") or {}), label.key: label.spot[0]}}
        od_spec = {**spec, "nodeSelector": {**(spec.get("nodeSelector") or {}), label.key: label.on_demand}}
        settings = BackfillSettings(policy.max_replicas, policy.fallback.after, policy.fallback.return_after,
                                    policy.on_demand_max)
        clocks = BackfillClocks(record.below_max_since, record.spot_idle_since)
        at = now()
        chosen = placement.place(settings, facts, self.cache.free_slots(key, spot_spec, ignore_own=False),
                                 self.cache.free_slots(key, od_spec, ignore_own=False), clocks, at)
        gates = {meta(p).get("name"): (p.get("spec") or {}).get("schedulingGates") or [] for p in pods}
        for name, where in chosen.pods:
            try:
                await asyncio.to_thread(self.effects.kube.patch, PODS, key[1], name,
                                        placement.placement_patch(label, where, gates.get(name, [])))
            except NotFound:
                continue
            log.info("job %s/%s: pod %s placed on %s: %s", key[1], key[2], name, where, chosen.step.reason)
        updated = record.with_(below_max_since=chosen.step.clocks.below_max_since,
                               spot_idle_since=chosen.step.clocks.spot_free_since, split=chosen.split)
        if chosen.pods:
            updated = updated.with_(backfill=chosen.step.reason, backfill_at=at)
        if updated != record:
            await self.effects.write_job(key, adapter, record_patch(obj, updated))
        return chosen.step.recheck_at


def pod_facts(pod: Mapping[str, Any], label, node: Mapping[str, Any] | None, members: tuple[str, ...],
              hosts_mode: str) -> placement.PodFacts:
    """One replica pod as placement sees it: a member when it runs on a node without a notice and
    the last membership lists its host (before any membership: when it runs), leaving when it
    runs on a noticed node. A pod that runs but was not admitted yet (a warm standby starting,
    a joiner waiting to be Ready) is starting, not a member: counted as a member, a standby
    still starting looked like an on-demand member, and a spot node that came back meanwhile
    was placed to replace it (the swap-back) before it ever joined."""
    running = (pod.get("status") or {}).get("phase") == "Running"
    noticed = node is not None and capacity.has_notice(node)
    listed = not members or membership.host_of(pod, hosts_mode) in members
    return placement.PodFacts(meta(pod).get("name", ""), pod_index(pod), placement.placed_on(pod, label),
                              member=running and node is not None and not noticed and listed,
                              leaving=running and noticed)
