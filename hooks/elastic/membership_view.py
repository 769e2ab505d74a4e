"""A rank's view of its group's hosts and of the memberships the supervisor pushes, and which
agreed notice changes the group in place.

Contract (all methods but `offer` run on the training thread):
- `learn_hosts(collectives)` (collective, after every formation): the hosts of the group in rank
  order, from every rank's `SPOTGUARD_NODE`.
- `offer(data)` (thread-safe; the sidecar's `membership` event): a membership newer than the last
  one seen whose hosts differ from the group's as a set, with a `store`, becomes pending; an
  older or equal generation, or one with the group's own hosts (the supervisor confirming what
  the ranks already did), only advances the generation. Malformed data is logged and ignored.
- `pending_notice()`: the pending membership as an internal `drain` notice (source
  `MEMBERSHIP_SOURCE`, no deadline) the agreement carries like any other, at a lower priority:
  a real notice held by any rank at the same boundary is agreed first.
- `plan_for(notice)`: the `Change` the agreed notice asks for, or None when every rank drains
  (today's path): a membership notice changes to its hosts; a reclaim, maintenance, GPU fault
  or a signal-borne drain names one host, which leaves while the others stay, when at least
  `min_world_size` ranks stay; a supervisor drain (the whole job) and notices naming no host of
  the group drain everyone.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

from spotguard.config import positive_int
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.wire import names
from spotguard.wire.membership import Membership, MembershipFormatError
from spotguard.wire.notice import Kind, Notice, now_utc

log = logging.getLogger("spotguard.hooks.elastic")

MEMBERSHIP_SOURCE = names.MEMBERSHIP_SOURCE
ONE_HOST_KINDS = frozenset({Kind.RECLAIM, Kind.MAINTENANCE, Kind.GPU_FAULT, Kind.DRAIN})


def _generation_of(notice: Notice) -> int:
    return int(notice.detail["generation"])


@dataclass(frozen=True)
class Change:
    """What an agreed notice asks of the group: re-form to `plan.target_hosts` at `prefix`."""

    plan: ReformPlan
    prefix: str  # the store prefix of the new group, unique to this formation
    store: str  # "host:port" of the new leader's store; "" when the leader is a survivor (it says)
    generation: int  # the membership generation this change reaches (-1: the ranks' own shrink)
    reason: str  # "membership" or the notice kind


class MembershipView:
    """See the module docstring."""

    def __init__(self, node: str, local_rank: int = 0, procs_per_host: int = 1, min_world_size: int = 1):
        self.node, self.local_rank, self.procs_per_host = node, local_rank, procs_per_host
        self.min_world_size = min_world_size
        self.hosts: tuple[str, ...] = ()
        self.generation = -1
        self.formations = 0
        self._pending: Notice | None = None  # the pending membership, as the notice the agreement carries
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MembershipView:
        env = dict(os.environ if env is None else env)
        node = env.get(names.ENV_NODE) or env.get("NODE_NAME") or env.get("HOSTNAME") or "localhost"
        return cls(node, positive_int("LOCAL_RANK", env.get("LOCAL_RANK") or 0, allow_zero=True),
                   positive_int("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE") or 1),
                   positive_int(names.ENV_MIN_WORLD_SIZE, env.get(names.ENV_MIN_WORLD_SIZE) or 1))

    def learn_hosts(self, collectives: Collectives) -> tuple[str, ...]:
        by_rank = collectives.gather_strings(self.node)
        self.hosts = tuple(by_rank[i] for i in range(0, len(by_rank), self.procs_per_host))
        self.formations += 1
        return self.hosts

    def adopt(self, generation: int) -> None:
        with self._lock:
            self.generation = max(self.generation, generation)
            if self._pending is not None and _generation_of(self._pending) <= self.generation:
                self._pending = None

    # ---- memberships in (listener thread) ---------------------------------------------------------
    def offer(self, data: dict) -> None:
        try:
            membership = Membership.from_wire(data)
        except MembershipFormatError as exc:
            log.warning("ignored a malformed membership event: %s", exc)
            return
        with self._lock:
            if membership.generation <= self.generation:
                return
            if not membership.hosts or set(membership.hosts) == set(self.hosts) or not membership.store:
                self.generation = membership.generation
                self._pending = None
                return
            self._pending = Notice(f"membership-{membership.generation}", Kind.DRAIN, MEMBERSHIP_SOURCE, self.node,
                                   now_utc(), None, {"membership": membership.to_json(),
                                                     "generation": membership.generation})
        log.warning("membership %d (%s) pending: the group re-forms at the next agreed step",
                    membership.generation, ", ".join(membership.hosts))

    def pending_notice(self) -> Notice | None:
        """The pending membership's notice (made once, when it was offered: read every step)."""
        return self._pending

    # ---- the agreed notice --------------------------------------------------------------------
    def plan_for(self, notice: Notice, step: int) -> Change | None:
        if not self.hosts:
            return None
        if notice.source == MEMBERSHIP_SOURCE:
            membership = Membership.from_json(str(notice.detail.get("membership", "")))
            plan = ReformPlan.make(self.hosts, membership.hosts, self.procs_per_host)
            if not plan.changes or not plan.survivors or plan.new_world_size < self.min_world_size:
                return None
            return Change(plan, f"m{membership.generation}/", membership.store, membership.generation, "membership")
        if notice.kind not in ONE_HOST_KINDS or notice.source == names.SUPERVISOR_DRAIN_SOURCE or notice.advisory:
            return None
        if notice.node not in self.hosts:
            return None
        target = tuple(h for h in self.hosts if h != notice.node)
        if not target or len(target) * self.procs_per_host < self.min_world_size:
            return None
        plan = ReformPlan.make(self.hosts, target, self.procs_per_host)
        # Every rank of the group computes the same prefix (a joiner's formation count differs
        # from the others'): one agreement per step, and steps only grow in a process's life.
        return Change(plan, f"s{step}-{len(target)}/", "", -1, notice.kind.value)


def membership_summary(change: Change) -> str:
    plan = change.plan
    return json.dumps({"from": list(plan.old_hosts), "to": list(plan.target_hosts), "reason": change.reason})
