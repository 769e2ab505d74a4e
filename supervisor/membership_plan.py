"""The membership a decision pushes to a job's pods, planned from the state. Pure.

`plan(record, pods, ...)` returns the record with the membership's fields (generation, hosts,
store, member pods, start generation, join-settle clock) as they must be written, and the
membership to push once it is (`MembershipPush`: the wire JSON and the pods whose annotation
differs). The controller writes the record, then pushes: a generation reaches the pods only
after the record that names it is stored, so a restarted supervisor never pushes it twice.

Rules (supervisor/README.md, in_place.py for the in-place ones):
- a return to spot under way (`drain` in the record, phase Checkpointing), any policy: the
  membership carries the drain request (its generation was raised by the decision that asked
  for it); an in-place job keeps its hosts and store, so only the drain is new;
- otherwise only elastic jobs the supervisor has acted on, running and not suspended, get one
  (an in-place start-at-min job also before: its first group, `in_place.start_members`);
- members are replica pods Running on a known node whose notice does not read as a departure
  (`JobPods.departing`; a rebalance or a maintenance beyond the horizon keeps its members) and
  that Kubernetes is not taking away (disruption.py);
- in place: the stable order, the store, joiners once Ready and settled, the replacement hold
  and the cap at max (in_place.py); a group that is gone gets the relaunched job's own group;
- once a pod of the job has Succeeded the training is over (a rank exits 0 only at its end; a leaver
  exits 83): no new membership, so the ranks still finishing are not told to re-form without the
  one that finished first, and a replacement scheduled onto its freed node is not admitted;
- a change of the hosts or the store raises the generation. The join-settle clock lives in the
  record (`ready_seen`: when each Ready joiner was first seen Ready), never in memory, so a
  restarted supervisor admits the joiners at the same moment.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from collections.abc import Callable, Mapping

from spotguard.supervisor import membership
from spotguard.supervisor.disruption import disrupted
from spotguard.supervisor.in_place import (fresh_members, group_gone, held_for_replacement, in_place_group,
                                           joiners_settled, ready_joiners, start_members, starting_joiners)
from spotguard.supervisor.record import CHECKPOINTING, RUNNING, Record
from spotguard.wire.membership import Membership

Pod = Mapping[str, Any]


@dataclass(frozen=True)
class JobPods:
    """A job's pods and their nodes, as the membership reads them.

    `replicas`: the active replica pods; `every`: every pod of the job (finished ones too: their
    exits carry the steps lost); `nodes`: the Nodes that exist among those the pods (and the
    notices awaited) name; `departing`: those whose notice reads as a departure now;
    `per_replica`: processes per replica pod; `on_demand_hosts`: hosts the backfill placed on
    on-demand capacity; `standby`: a backfill job with a spare (its memberships say so, and a
    departing member stays listed while its replacement is on its way)."""

    replicas: tuple[Pod, ...] = ()
    every: tuple[Pod, ...] = ()
    nodes: frozenset[str] = frozenset()
    departing: frozenset[str] = frozenset()
    hosts_mode: str = "node"
    per_replica: int = 1
    on_demand_hosts: frozenset[str] = frozenset()
    standby: bool = False

    def on_healthy_node(self, pod: Pod) -> bool:
        """The pod is bound to a known node that is not departing, and Kubernetes is not taking
        the pod itself away: only then can it be a member."""
        node = (pod.get("spec") or {}).get("nodeName") or ""
        return node in self.nodes and node not in self.departing and not disrupted(pod)

    def on_departing_node(self, pod: Pod) -> bool:
        """The pod is bound to a departing node and nothing else takes it away: a member the
        replacement hold may keep listed (in_place.py)."""
        node = (pod.get("spec") or {}).get("nodeName") or ""
        return node in self.departing and node in self.nodes and not disrupted(pod)

    def finished(self) -> bool:
        """A pod of the job has Succeeded: its training has ended."""
        return any((p.get("status") or {}).get("phase") == "Succeeded" for p in self.every)

    def running_members(self) -> list[Pod]:
        """Replica pods Running on healthy nodes (the elastic, not in-place, members)."""
        return [p for p in self.replicas if (p.get("status") or {}).get("phase") == "Running"
                and self.on_healthy_node(p)]


@dataclass(frozen=True)
class MembershipPush:
    """A membership to push: its wire JSON, its generation and hosts, the names of the replica
    pods whose annotation differs from it, and what made its generation new ("": not new)."""

    value: str
    generation: int
    hosts: tuple[str, ...]
    pods: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class Planned:
    """`record` with the membership's fields; `push` what to tell the pods (None: nothing);
    `recheck_at` when held joiners are due."""

    record: Record
    push: MembershipPush | None = None
    recheck_at: datetime | None = None


@dataclass(frozen=True)
class JobShape:
    """What of the job's policy the membership depends on."""

    elastic: bool
    in_place: bool = False
    start_at_min: int = 0  # min-replicas of an in-place start-at-min job; 0: not one
    limit: int | None = None  # max-replicas: no membership lists more hosts
    suspended: bool = False  # the job is (or is about to be) suspended
    replicas: int = 0  # the replicas the job asks for (a relaunched group waits for all of them)


def plan(record: Record, pods: JobPods, shape: JobShape, now: datetime, settle: float) -> Planned:
    """The membership for the job after its decision (`record`): see the module docstring."""
    if record.drain and record.phase == CHECKPOINTING:
        return _drain(record, pods)
    if not shape.elastic or record.phase != RUNNING or shape.suspended or pods.finished():
        return Planned(record)
    if shape.start_at_min and shape.in_place:
        if not record.members or group_gone(pods.replicas, record.member_pods):
            return _start_group(record, pods, shape)
    elif record.decided_at is None:
        return Planned(record)
    if not shape.in_place:
        members = pods.running_members()
        hosts = membership.hosts_of(members, pods.hosts_mode)
        count = len(hosts) if pods.hosts_mode == "node" else len(members)
        return _pushed(record, pods, hosts, "", (), count)
    if group_gone(pods.replicas, record.member_pods):
        return _fresh_group(record, pods, shape.replicas)
    return _in_place(record, pods, shape, now, settle)


def _in_place(record: Record, pods: JobPods, shape: JobShape, now: datetime, settle: float) -> Planned:
    previous, mode = record.members, pods.hosts_mode
    ready = ready_joiners(pods.replicas, previous, mode, pods.on_healthy_node)
    earlier = record.ready_seen or {}
    seen = {uid: earlier.get(uid, now) for uid in (_uid(p) for p in ready)}
    starting = starting_joiners(pods.replicas, previous, mode, pods.on_healthy_node)
    admit = joiners_settled([(now - t).total_seconds() for t in seen.values()], len(starting), settle)
    recheck = None if admit or not seen else min(seen.values()) + timedelta(seconds=settle)
    record = record.with_(ready_seen=None if admit or not seen else seen)
    member_node: Callable[[Pod], bool] = pods.on_healthy_node
    if pods.standby:
        member_node = held_for_replacement(pods.replicas, previous, mode, pods.on_healthy_node,
                                           pods.on_departing_node, admit)
    hosts, store, incarnations = in_place_group(pods.replicas, previous, mode, member_node, admit, shape.limit,
                                                pods.on_demand_hosts)
    if hosts and not store:
        return Planned(record, recheck_at=recheck)  # the first host's pod has no IP yet: its update requeues
    planned = _pushed(record, pods, hosts, store, incarnations, len(hosts), in_place=True)
    return Planned(planned.record, planned.push, recheck)


def _pushed(record: Record, pods: JobPods, hosts: tuple[str, ...], store: str, incarnations: tuple[str, ...],
            count: int, *, in_place: bool = False, why: str = "") -> Planned:
    """The membership of `hosts` (`count` replicas), a new generation when the hosts or the store
    changed (`why` says what made it when the caller knows better than "members changed")."""
    if not hosts:
        return Planned(record)
    if hosts != record.members or store != record.store:
        why = why or "members changed"
        record = record.with_(generation=record.generation + 1, members=hosts, store=store,
                              member_pods=incarnations)
    elif incarnations and not record.member_pods:  # a record from before member_pods: learn them
        record = record.with_(member_pods=incarnations)
    start = in_place and record.generation == record.start_generation > 0  # the first group, told again
    value = membership.membership_json(record.generation, hosts, count * pods.per_replica, store=store,
                                       start=start, standby=pods.standby, first=_first(record, pods, in_place))
    return Planned(record, _push(pods, value, record.generation, hosts, why))


def _first(record: Record, pods: JobPods, in_place: bool) -> Membership | None:
    """The `start` membership a later membership of a start-at-min job descends from, while
    every pod the start listed is still a member in the same incarnation: only then can a host
    it lists be a pod that never read it. A host name comes back with a new pod (a reclaimed
    node given back, a restarted container), which must join the live group, never form the
    first one again from the checkpoint. None before the start, for the start itself, and for jobs without one."""
    if not in_place or not record.start_hosts or not record.start_store or not record.start_pods \
            or not 0 < record.start_generation < record.generation \
            or not set(record.start_pods) <= set(record.member_pods):
        return None
    return Membership(record.start_generation, record.start_hosts, len(record.start_hosts) * pods.per_replica,
                      store=record.start_store, start=True)


def _fresh_group(record: Record, pods: JobPods, replicas: int) -> Planned:
    """Every member of the in-place group is gone: once all `replicas` pods of the relaunched
    job run, its own group (completion-index order, the lowest index's store)."""
    fresh = fresh_members(pods.replicas, replicas, pods.hosts_mode)
    if fresh is None:
        return Planned(record)  # the relaunched pods' updates requeue the job
    hosts, store, incarnations = fresh
    record = record.with_(members=(), store="")  # always a new generation, even on the same hosts
    return _pushed(record, pods, hosts, store, incarnations, len(hosts), why="the relaunched group")


def _start_group(record: Record, pods: JobPods, shape: JobShape) -> Planned:
    """A start-at-min job without a running group: once min pods are Ready, their first
    membership (marked `start`, at most max hosts), as a new generation."""
    found = start_members(pods.replicas, shape.start_at_min, pods.hosts_mode, pods.on_healthy_node, shape.limit)
    if found is None:
        return Planned(record)  # the pods' updates requeue the job
    hosts, store, incarnations = found
    record = record.with_(members=(), store="", start_generation=record.generation + 1, start_hosts=hosts,
                          start_store=store, start_pods=incarnations)
    return _pushed(record, pods, hosts, store, incarnations, len(hosts), in_place=True,
                   why=f"{len(hosts)} of min {shape.start_at_min} pods Ready: the first group")


def _drain(record: Record, pods: JobPods) -> Planned:
    """The return to spot's drain request, on the membership of the job's members."""
    members = pods.running_members()
    hosts, count = membership.hosts_of(members, pods.hosts_mode), len(members)
    if record.store:  # in place: the group's own hosts and store
        hosts, count = record.members, len(record.members)
    value = membership.membership_json(record.generation, hosts, count * pods.per_replica, drain=record.drain,
                                       store=record.store)
    return Planned(record, _push(pods, value, record.generation, hosts))


def _push(pods: JobPods, value: str, generation: int, hosts: tuple[str, ...], why: str = "") -> MembershipPush:
    stale = membership.pods_to_update(pods.replicas, value)
    names = tuple(str((p.get("metadata") or {}).get("name") or "") for p in stale)
    return MembershipPush(value, generation, hosts, names, why)


def _uid(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name", ""))
