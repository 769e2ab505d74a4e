"""Placement: how ONE Indexed Job (or PyTorchJob) holds both spot and on-demand pods. Pure.

The job's pod template admits both capacity types (its required node affinity names a
capacity-type label of capacity_type.py with both values, e.g. `karpenter.sh/capacity-type In
[spot, on-demand]`) and carries the scheduling gate `spotguard.io/capacity`. Every replica pod
is therefore created gated (the scheduler leaves it Pending), and the supervisor places it: one
merge patch of the pod that adds `nodeSelector: {<label>: <spot or on-demand value>}` and
removes the gate. Kubernetes allows exactly that on a gated pod (a nodeSelector may only gain
keys while the pod is gated; a gate may only be removed), so the supervisor needs no verb it
lacks: `patch` on pods it has (the membership annotation); the admission policy lets its
ServiceAccount change a pod's spec only in this way (daemonset/base/supervisor/admission-policy.yaml).

`place(settings, pods, spot_free, on_demand_free, clocks, now)` applies backfill.plan to the job's
replica pods (`PodFacts`) and names the gated pods to place on spot and on-demand, lowest
completion index first: spot for every free spot slot at once, on-demand once the job has been
below max for `fallback-after` (or at once for a pod replacing one with a notice), and for a
swap-back one spot pod.

The spare: the warm standby and the swap-back need a pod that exists before the member it
replaces is gone, so such a job asks for one replica more than `spotguard.io/max-replicas`
(Indexed Job: parallelism = completions = max + 1; PyTorchJob: Worker replicas). The membership
never lists more than max hosts (in_place.py `capped`), so the extra pod is a spare: it stays
gated while the job is whole, is placed at once when a member gets a notice (spot where spot has
been free for return-after, else on-demand: backfill.py) or for a swap-back (spot), and joins in
place when Ready; in a swap it takes one on-demand member's place in the same membership, and
that member's ranks leave and exit 83, after which the Job controller (podFailurePolicy Ignore on
83) re-creates its index gated: the next spare. Ranks then come from the supervisor's
memberships, not from completion indices, so a job with a spare must start at min
(`spotguard.io/start-at-min`; policy.py refuses it otherwise).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotguard.supervisor import capacity_type, membership
from spotguard.supervisor.backfill import BackfillClocks, BackfillSettings, BackfillStep, BackfillView, plan

GATE = "spotguard.io/capacity"
SPOT, ON_DEMAND = capacity_type.SPOT, capacity_type.ON_DEMAND


@dataclass(frozen=True)
class PodFacts:
    """One active replica pod as placement sees it. `capacity`: "" while gated, else where it was
    placed (its added nodeSelector, or the capacity type of its node); `member`: running on a node
    without a notice; `leaving`: running on a node with one."""

    name: str
    index: int
    capacity: str = ""
    member: bool = False
    leaving: bool = False


@dataclass(frozen=True)
class Placement:
    """The gated pods to place (`(pod name, SPOT | ON_DEMAND)`), the step it came from, and the
    replica split after it."""

    pods: tuple[tuple[str, str], ...]
    step: BackfillStep
    split: dict[str, int]


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod still carries the supervisor's scheduling gate."""
    return any(g.get("name") == GATE for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def capacity_label(directives: Mapping[str, Any]) -> capacity_type.CapacityLabel | None:
    """The capacity-type label the template's required node affinity (or nodeSelector) names,
    with a positive on-demand value (placement adds `label: value` to the pod's nodeSelector)."""
    keys = list(directives.get("nodeSelector") or {})
    terms = (((directives.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    keys += [e.get("key", "") for t in terms for e in t.get("matchExpressions") or []]
    for key in keys:
        label = capacity_type.BY_KEY.get(key)
        if label is not None and label.on_demand is not None:
            return label
    return None


def placed_on(pod: Mapping[str, Any], label: capacity_type.CapacityLabel) -> str:
    """SPOT, ON_DEMAND, or "" (not placed) from the pod's own nodeSelector."""
    value = ((pod.get("spec") or {}).get("nodeSelector") or {}).get(label.key)
    if value in label.spot:
        return SPOT
    return ON_DEMAND if value == label.on_demand else ""


def on_demand_hosts(pods: Iterable[Mapping[str, Any]], pod_spec: Mapping[str, Any], hosts_mode: str) -> frozenset[str]:
    """Hosts of the replica `pods` the backfill placed on on-demand capacity (empty when the job's
    template names no capacity-type label with an on-demand value)."""
    label = capacity_label(pod_spec)
    if label is None:
        return frozenset()
    return frozenset(membership.host_of(p, hosts_mode) for p in pods if placed_on(p, label) == ON_DEMAND)


def placement_patch(label: capacity_type.CapacityLabel, where: str, gates: Sequence[Mapping[str, Any]] = ()) -> dict:
    """The pod merge patch that places it: the nodeSelector key added, the supervisor's gate
    removed from the pod's `gates` (another gate's owner keeps its own)."""
    value = label.spot[0] if where == SPOT else label.on_demand
    rest = [dict(g) for g in gates if g.get("name") != GATE]
    return {"spec": {"nodeSelector": {label.key: value}, "schedulingGates": rest or None}}


def place(settings: BackfillSettings, pods: Sequence[PodFacts], spot_free: int, on_demand_free: int,
          clocks: BackfillClocks, now: datetime) -> Placement:
    """The pods to place now (module docstring). Placed pods not yet members count as starting and
    use up the free slots they will take."""
    starting = [p for p in pods if p.capacity and not p.member and not p.leaving]
    starting_spot = sum(p.capacity == SPOT for p in starting)
    starting_on_demand = sum(p.capacity == ON_DEMAND for p in starting)
    members = [p for p in pods if p.member]
    view = BackfillView(spot=sum(p.capacity != ON_DEMAND for p in members),
                        on_demand=sum(p.capacity == ON_DEMAND for p in members),
                        leaving=sum(p.leaving for p in pods),
                        starting_spot=starting_spot, starting_on_demand=starting_on_demand,
                        spot_free=max(0, spot_free - starting_spot),
                        on_demand_free=max(0, on_demand_free - starting_on_demand))
    step = plan(settings, view, clocks, now)
    waiting = sorted((p for p in pods if not p.capacity), key=lambda p: p.index)
    spot_count = step.add_spot
    chosen = [(p.name, SPOT) for p in waiting[:spot_count]]
    chosen += [(p.name, ON_DEMAND) for p in waiting[spot_count:spot_count + step.add_on_demand]]
    if step.swap and len(waiting) > len(chosen):  # the spare, on spot, to take an on-demand member's place
        chosen.append((waiting[len(chosen)].name, SPOT))
    split = {SPOT: sum(p.capacity == SPOT for p in pods) + sum(w == SPOT for _, w in chosen),
             ON_DEMAND: sum(p.capacity == ON_DEMAND for p in pods) + sum(w == ON_DEMAND for _, w in chosen)}
    return Placement(tuple(chosen), step, split)
