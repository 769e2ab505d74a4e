"""A rank's view of its group's hosts and of the memberships the supervisor pushes, and which
agreed notice changes the group in place.

Contract (all methods but `offer` run on the training thread):
- `learn_hosts(collectives)` (collective, after every formation): the hosts of the group in rank
  order, from every rank's `SPOTGUARD_NODE`.
- `offer(data)` (thread-safe; the sidecar's `membership` event): a membership newer than the last
  one seen whose hosts differ from the group's as a set, with a `store`, becomes pending; one
  with the group's own hosts (the supervisor confirming what the ranks already did) only
  advances the generation; the same generation again (a re-sent one) changes nothing. Every
  membership taken (pending or adopted) sets `standby`, its warm-standby flag: a noticed member's
  replacement is asked for at once (the Guard's replacement hold reads it). Bad input
  is refused with ONE log line naming the field, and training goes on: malformed data (a host
  listed twice: `hosts`), an older generation than the last seen (`generation`), and one that
  changes the hosts but names no rendezvous store (`store`).
- `after_change(plan, started_at)` (after every change this rank continues from): the pending
  membership is re-checked against the new group: one with the new group's hosts only gives its
  generation; one offered before the change that names a host the change took out (it was
  written before that host left) is dropped (its generation counts as seen). One offered after
  the change began stays pending.
- `pending_notice()`: the pending membership, as the record a change carries (source
  `MEMBERSHIP_SOURCE`, the membership in `detail`, no deadline). The Guard contributes its
  generation to the agreement's own membership field (`agreement.base`): a real notice held by
  any rank at the same boundary is agreed first.
- `plan_for(notice)`: the `Change` the agreed notice asks for, `Settled` when it is an agreed
  membership that asks nothing (its hosts are the group's, or it was written before one of its
  hosts left the group: the Guard adopts its generation and training goes on; a membership
  never makes everyone drain for that), or None when every rank drains (today's path: a
  membership with no host of the group, or fewer than `min_world_size` ranks); a membership
  notice changes to its hosts; a reclaim, maintenance, GPU fault
  or a signal-borne drain names one host, which leaves while the others stay, when at least
  `min_world_size` ranks stay; a supervisor drain (the whole job) and notices naming no host of
  the group drain everyone.
- Which hosts form the new group is `hostfile.group_after`, the rule the sidecar writes the
  DeepSpeed hostfile by, each host with `procs_per_host` slots, under the elasticity rule of
  `SPOTGUARD_DEEPSPEED_CONFIG` (`rule`; none without it): a shrink to a world size the rule
  does not allow trims to the largest one it allows, keeping the hosts listed first (the ranks'
  order; the hosts trimmed leave with the noticed one, as the hostfile drops them), and a
  membership's hosts are trimmed alike, in its order (`trimmed`, which
  a joiner and a first group read their rank and world from; one trimmed to the group's own
  hosts is `Settled`); nothing allowed (or fewer than `min_world_size` ranks): every rank drains.
  `learn_hosts` also gathers every rank's rule: ranks that read different configs take rank 0's
  (logged once); a joiner trims by its own, so a pod that reads another config than the group's
  fails to form with it (the change falls back). A bad config stops `from_env` with a
  ConfigError naming the variable.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from dataclasses import dataclass

from spotguard.config import ConfigError, positive_int
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.hooks.hostfile import ElasticityError, ElasticRule, Host, elastic_rule_from_config, group_after
from spotguard.wire import names, notice_policy
from spotguard.wire.membership import Membership, MembershipFormatError
from spotguard.wire.notice import Kind, Notice, now_utc

log = logging.getLogger("spotguard.hooks.elastic")

MEMBERSHIP_SOURCE = names.MEMBERSHIP_SOURCE


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


@dataclass(frozen=True)
class Settled:
    """An agreed membership that asks nothing of the group: adopt `generation`, train on."""

    generation: int
    why: str


class MembershipView:
    """See the module docstring."""

    def __init__(self, node: str, local_rank: int = 0, procs_per_host: int = 1, min_world_size: int = 1,
                 rule: ElasticRule | None = None):
        self.node, self.local_rank, self.procs_per_host = node, local_rank, procs_per_host
        self.min_world_size = min_world_size
        self.rule = rule
        self.hosts: tuple[str, ...] = ()
        self.generation = -1
        self.formations = 0
        self.standby = False  # the newest membership's warm-standby flag
        self._pending: Notice | None = None  # the pending membership, as the notice the agreement carries
        self._departed: dict[str, float] = {}  # host -> time.time() the change that took it out began
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MembershipView:
        env = dict(os.environ if env is None else env)
        node = env.get(names.ENV_NODE) or env.get("NODE_NAME") or env.get("HOSTNAME") or "localhost"
        rule = None
        if config := env.get(names.ENV_DEEPSPEED_CONFIG):
            try:
                rule = elastic_rule_from_config(config)
            except ElasticityError as exc:
                raise ConfigError(names.ENV_DEEPSPEED_CONFIG, str(exc)) from None
        return cls(node, positive_int("LOCAL_RANK", env.get("LOCAL_RANK") or 0, allow_zero=True),
                   positive_int("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE") or 1),
                   positive_int(names.ENV_MIN_WORLD_SIZE, env.get(names.ENV_MIN_WORLD_SIZE) or 1), rule)

    def learn_hosts(self, collectives: Collectives) -> tuple[str, ...]:
        rule = "" if self.rule is None else ",".join(map(str, (self.rule.batch_size, *self.rule.world_sizes)))
        by_rank = [text.partition("\t") for text in collectives.gather_strings(f"{self.node}\t{rule}")]
        self.hosts = tuple(by_rank[i][0] for i in range(0, len(by_rank), self.procs_per_host))
        rules = [rank[2] for rank in by_rank]
        if any(other != rules[0] for other in rules):
            if self.formations == 0:
                log.error("the ranks read different elasticity rules (batch size, world sizes: %s): every rank "
                          "takes rank 0's; give every pod the same %s",
                          " / ".join(sorted(set(rules), key=rules.index)) or "none", names.ENV_DEEPSPEED_CONFIG)
            numbers = [int(n) for n in rules[0].split(",")] if rules[0] else []
            self.rule = ElasticRule(numbers[0], tuple(numbers[1:])) if numbers else None
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
        except MembershipFormatError as exc:  # the message names the field
            log.warning("membership refused: %s; training goes on", exc)
            return
        with self._lock:
            newest = max(self.generation, _generation_of(self._pending) if self._pending is not None else -1)
            if membership.generation == newest:
                return  # sent again
            if membership.generation < newest:
                refusal = f"generation: {membership.generation} goes back (generation {newest} was seen)"
            elif not membership.hosts or set(membership.hosts) == set(self.hosts):
                self.standby = membership.standby
                self.generation = membership.generation
                self._pending = None
                return
            elif not membership.store:
                refusal = "store: it changes the hosts but names no rendezvous store"
            else:
                refusal = ""
                self.standby = membership.standby
                self._pending = Notice(f"membership-{membership.generation}", Kind.DRAIN, MEMBERSHIP_SOURCE,
                                       self.node, now_utc(), None, {"membership": membership.to_json(),
                                                                    "generation": membership.generation})
        if refusal:
            log.warning("membership %d refused: %s; training goes on", membership.generation, refusal)
            return
        log.warning("membership %d (%s) pending: the group re-forms at the next agreed step",
                    membership.generation, ", ".join(membership.hosts))

    def after_change(self, plan: ReformPlan, started_at: float) -> None:
        """See the module docstring (`started_at`: time.time() when the change began)."""
        with self._lock:
            for host in plan.leaving_hosts:
                self._departed[host] = started_at
            for host in plan.joining_hosts:
                self._departed.pop(host, None)
            pending = self._pending
            if pending is None:
                return
            settled = self._settles(pending)
            if settled is None:
                return
            self.generation = max(self.generation, settled.generation)
            self._pending = None
        log.warning("membership %d dropped: %s", settled.generation, settled.why)

    def _settles(self, notice: Notice, stale_rule: bool = True) -> Settled | None:
        """Settled when the membership `notice` asks nothing of the group as it is now."""
        membership = Membership.from_json(str(notice.detail.get("membership", "")))
        if set(membership.hosts) == set(self.hosts):
            return Settled(membership.generation, "the group already has its hosts")
        if not stale_rule:
            return None
        offered = notice.detected_at.timestamp()
        stale = sorted(h for h in membership.hosts if self._departed.get(h, float("-inf")) > offered)
        if stale:
            return Settled(membership.generation, f"it was written before {', '.join(stale)} left the group")
        return None

    def pending_notice(self) -> Notice | None:
        """The pending membership's notice (made once, when it was offered: read every step)."""
        return self._pending

    # ---- the agreed notice --------------------------------------------------------------------
    def plan_for(self, notice: Notice, step: int, settle: bool = True) -> Change | Settled | None:
        """`settle=False`: never `Settled` for a membership whose hosts differ from the group's
        (the Guard's rank 0 found it current)."""
        if not self.hosts:
            return None
        if notice.source == MEMBERSHIP_SOURCE:
            with self._lock:
                settled = self._settles(notice, stale_rule=settle)
            if settled is not None:
                return settled
            membership = Membership.from_json(str(notice.detail.get("membership", "")))
            target = self._group_of(membership.hosts, ())
            if target is None:
                return None
            if set(target) == set(self.hosts):
                return Settled(membership.generation, "the elasticity rule keeps the group's own hosts of it")
            plan = ReformPlan.make(self.hosts, target, self.procs_per_host)
            if not plan.survivors:
                return None
            return Change(plan, f"m{membership.generation}/", membership.store, membership.generation, "membership")
        if not notice_policy.announces_departure(notice) or notice.source == names.SUPERVISOR_DRAIN_SOURCE:
            return None
        if notice.node not in self.hosts:
            return None
        target = self._group_of(self.hosts, (notice.node,))
        if target is None:
            return None
        plan = ReformPlan.make(self.hosts, target, self.procs_per_host)
        # Every rank of the group computes the same prefix (a joiner's formation count differs
        # from the others'): one agreement per step, and steps only grow in a process's life.
        return Change(plan, f"s{step}-{len(target)}/", "", -1, notice.kind.value)


    def trimmed(self, membership: Membership) -> Membership:
        """`membership` with the hosts `group_after` keeps of it under the rule, its `first` alike
        (a joiner's and a first group's rank and world come from these: the survivors re-form to
        the same hosts); itself without a rule."""
        if self.rule is None:
            return membership
        kept = self._kept(membership.hosts, ())
        first = self.trimmed(membership.first) if membership.first is not None else None
        return dataclasses.replace(membership, hosts=kept, world_size=len(kept) * self.procs_per_host, first=first)

    def _group_of(self, hosts: tuple[str, ...], departing: tuple[str, ...]) -> tuple[str, ...] | None:
        """`hostfile.group_after` over `hosts`, `procs_per_host` slots each, under the rule; None
        when nothing fits or fewer than `min_world_size` ranks would stay (module docstring)."""
        kept = self._kept(hosts, departing)
        allowed = ", ".join(map(str, self.rule.world_sizes)) if self.rule is not None else ""
        if not kept or len(kept) * self.procs_per_host < self.min_world_size:
            if self.rule is not None and not kept:
                log.warning("no world size the elasticity rule allows (%s) fits hosts %s less %s: every rank drains",
                            allowed, ", ".join(hosts), ", ".join(departing) or "none")
            return None
        if trimmed := [h for h in hosts if h not in kept and h not in departing]:
            log.warning("the elasticity rule allows world sizes %s: %s leave(s) the group too, as the hostfile "
                        "drops them", allowed, ", ".join(trimmed))
        return kept


    def _kept(self, hosts: tuple[str, ...], departing: tuple[str, ...]) -> tuple[str, ...]:
        """`hostfile.group_after` over `hosts`, `procs_per_host` slots each, under the rule."""
        return tuple(h.name for h in group_after([Host(h, self.procs_per_host) for h in hosts], departing,
                                                 rule=self.rule))


def membership_summary(change: Change) -> str:
    plan = change.plan
    return json.dumps({"from": list(plan.old_hosts), "to": list(plan.target_hosts), "reason": change.reason})
