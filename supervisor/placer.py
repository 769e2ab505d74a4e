"""The placement pass of a backfill job (an elastic in-place job with `spotguard.io/fallback:
on-demand` whose pod template carries the `spotguard.io/capacity` gate; placement.py), in two
halves around the pass's one write of the job:
- `plan` reads the job's replica pods and the free spot / on-demand slots from the cache, asks
  `placement.place`, and returns the record with the backfill fields (clocks, split, last
  placement) as they must be written, with the `Placing` to apply once they are;
- `apply` patches each chosen pod (nodeSelector key added, gate removed).
A placement is a decision: the record keeps it (`backfill`: why, and which pod goes where;
`backfill_at`; `backfill_event`: its Event's reason, `placement_event`), and the reconciler posts
its Event after the write (effects.py `ensure_placement_event`), like the policy's decisions.
Level-triggered and idempotent: a placed pod is no longer gated, so a pass repeated after a
restart places nothing twice. A member is leaving when its node's notice reads as a departure
(the reconciler's `departing` nodes; a rebalance or a maintenance beyond the horizon asks for no
warm standby) or when Kubernetes takes its pod away (`disruption.being_taken`: a preemption or
an eviction, Terminating included). A member of the membership the pass started from
(`members_before`, the record's `member_pods`) whose pod Kubernetes removed before a pass saw it
leave counts as departed (`disruption.departed`): its warm standby too is placed at once.
`Placing.recheck_at` says when to look again (the fallback-after or return-after clock), or None.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from collections.abc import Collection, Mapping

from spotguard.kube.api import PODS, NotFound
from spotguard.supervisor import capacity, capacity_type, membership, placement
from spotguard.supervisor.disruption import being_taken, departed
from spotguard.supervisor.backfill import BackfillClocks, BackfillSettings, BackfillStep
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey, meta
from spotguard.supervisor.decision import Policy
from spotguard.supervisor.effects import JobEffects
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.record import Record
from spotguard.wire import names

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


def placement_event(step: BackfillStep) -> str:
    """The reason of the Event of a placement made for `step`: a swap-back, a warm standby (a
    leaving member's replacement, on either capacity), on-demand after fallback-after, or spot."""
    if step.swap:
        return names.EVENT_SWAPPING_TO_SPOT
    if step.standby:
        return names.EVENT_WARM_STANDBY
    return names.EVENT_BACKFILLED if step.add_on_demand else names.EVENT_PLACED_ON_SPOT


@dataclass(frozen=True)
class Placing:
    """What `apply` patches: the placement chosen, the label it sets, each pod's gates now."""

    chosen: placement.Placement
    label: capacity_type.CapacityLabel
    gates: Mapping[str, list]

    @property
    def recheck_at(self) -> datetime | None:
        return self.chosen.step.recheck_at


class Placer:
    """See the module docstring."""

    def __init__(self, cache: ClusterCache, effects: JobEffects, hosts_mode: str = "node"):
        self.cache = cache
        self.effects = effects
        self.hosts_mode = hosts_mode  # how the membership names a pod's host (membership.host_of)

    def wants(self, policy: Policy, obj: Mapping[str, Any], adapter: JobAdapter) -> bool:
        """Whether the job places its own pods: in place, the fallback on, its template gated."""
        spec = adapter.pod_spec(obj)
        return (policy.in_place and policy.fallback is not None
                and any(g.get("name") == placement.GATE for g in spec.get("schedulingGates") or []))

    def plan(self, key: JobKey, obj: Mapping[str, Any], adapter: JobAdapter, policy: Policy, record: Record,
             departing: Collection[str], at: datetime, members_before: Collection[str] = ()
             ) -> tuple[Record, Placing | None]:
        """(`record` with the backfill fields of this pass, what to place once it is written).
        `members_before`: the member incarnations the pass started from (empty for a job being
        suspended, whose pods its controller deletes)."""
        spec = adapter.pod_spec(obj)
        label = placement.capacity_label(spec)
        if label is None or policy.fallback is None:
            return record, None
        every = self.cache.pods_of(key)
        pods = [p for p in every if adapter.is_replica_pod(p) and (capacity.pod_active(p) or being_taken(p))]
        facts = [pod_facts(p, label, known=((p.get("spec") or {}).get("nodeName") or "") in self.cache.nodes,
                           departing=departing, members=record.members, hosts_mode=self.hosts_mode) for p in pods]
        spot_spec = {**spec, "nodeSelector": {**(spec.get("nodeSelector") or {}), label.key: label.spot[0]}}
        od_spec = {**spec, "nodeSelector": {**(spec.get("nodeSelector") or {}), label.key: label.on_demand}}
        settings = BackfillSettings(policy.max_replicas, policy.fallback.after, policy.fallback.return_after,
                                    policy.on_demand_max)
        clocks = BackfillClocks(record.below_max_since, record.spot_idle_since)
        chosen = placement.place(settings, facts, self.cache.free_slots(key, spot_spec, ignore_own=False),
                                 self.cache.free_slots(key, od_spec, ignore_own=False), clocks, at,
                                 departed(members_before, every))
        updated = record.with_(below_max_since=chosen.step.clocks.below_max_since,
                               spot_idle_since=chosen.step.clocks.spot_free_since, split=chosen.split)
        if chosen.pods:
            where = ", ".join(f"{name} on {capacity}" for name, capacity in chosen.pods)
            updated = updated.with_(backfill=f"{chosen.step.reason} ({where})", backfill_at=at,
                                    backfill_event=placement_event(chosen.step))
        gates = {meta(p).get("name", ""): (p.get("spec") or {}).get("schedulingGates") or [] for p in pods}
        return updated, Placing(chosen, label, gates)

    async def apply(self, key: JobKey, placing: Placing) -> None:
        """Places the pods `placing` chose (a pod gone meanwhile is skipped)."""
        for name, where in placing.chosen.pods:
            if not self.effects.is_leader():
                return
            try:
                await asyncio.to_thread(self.effects.kube.patch, PODS, key[1], name,
                                        placement.placement_patch(placing.label, where, placing.gates.get(name, [])))
            except NotFound:
                continue
            log.info("job %s/%s: pod %s placed on %s: %s", key[1], key[2], name, where, placing.chosen.step.reason)


def pod_facts(pod: Mapping[str, Any], label: capacity_type.CapacityLabel, *, known: bool,
              departing: Collection[str], members: Collection[str], hosts_mode: str) -> placement.PodFacts:
    """One replica pod as placement sees it (`known`: its node is in the cache). Leaving when it
    runs on a departing node (notice_policy's departures, the reconciler's `departing`) or
    Kubernetes is taking it away (disruption.being_taken: a scheduler preemption, an eviction).
    A member when it runs on a known node, is not leaving, and the last membership lists its host
    (before any membership: when it runs). A pod that runs but was not admitted yet (a warm
    standby starting, a joiner waiting to be Ready) is starting, not a member: counted as a
    member, a standby still starting looked like an on-demand member, and a spot node that came
    back meanwhile was placed to replace it (the swap-back) before it ever joined."""
    node_name = (pod.get("spec") or {}).get("nodeName") or ""
    running = (pod.get("status") or {}).get("phase") == "Running"
    leaving = (running and known and node_name in departing) or being_taken(pod)
    listed = not members or membership.host_of(pod, hosts_mode) in members
    return placement.PodFacts(meta(pod).get("name", ""), pod_index(pod), placement.placed_on(pod, label),
                              member=running and known and not leaving and listed, leaving=leaving)
