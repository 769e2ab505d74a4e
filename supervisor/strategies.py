"""What differs between the policies, as strategies of `policy.decide`. Pure.

- elastic: on a new departing notice, scale to the replicas running on unaffected nodes when
  that is >= min, else suspend ("below min"); scale back out toward max as capacity returns (no
  sooner than `scale_out_delay` after the last decision, so a flapping node does not thrash it).
- elastic in place: a notice only records itself (the noticed node's pod leaves by itself, its
  replacement joins: in_place.py, membership_plan.py); below min it suspends as elastic.
- fixed: on a new departing notice, wait for the checkpoint (policy.py's checkpoint rows), then
  suspend; resume when capacity for all replicas exists.
"""
from __future__ import annotations

from datetime import timedelta

from spotguard.supervisor.decision import (ELASTIC, FIXED, RECORD, SCALE, SUSPEND, Context, Decision, NoticeHit,
                                           Policy, decision_key)
from spotguard.supervisor.record import CHECKPOINTING, RUNNING, SUSPENDED, Record
from spotguard.wire import names


class Strategy:
    """What differs between the policies: how many replicas a resume needs and gets, what a new
    notice does, and what a running job does without one."""

    def resume_need(self, c: Context) -> int:
        raise NotImplementedError

    def resume_target(self, c: Context, need: int, slots: int) -> int:
        raise NotImplementedError

    def on_notices(self, c: Context, new: list[NoticeHit]) -> Decision:
        raise NotImplementedError

    def when_running(self, c: Context) -> Decision:
        return c.stay()


class ElasticStrategy(Strategy):
    """Scale to the replicas on unaffected nodes (suspend below min); scale back out toward max."""

    def resume_need(self, c: Context) -> int:
        return c.policy.min_replicas

    def resume_target(self, c: Context, need: int, slots: int) -> int:
        return min(c.policy.max_replicas, slots)

    def on_notices(self, c: Context, new: list[NoticeHit]) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        ids, nodes, handled = notice_facts(rec, new)
        target = min(state.healthy_replicas, policy.max_replicas)
        if target >= policy.min_replicas:
            return c.act(SCALE, event=names.EVENT_SCALED, replicas=target, key=decision_key("scale", *ids),
                         message=(f"notice {', '.join(ids)} on {nodes}: scaling from {state.replicas} to the {target} "
                                  f"replicas on unaffected nodes (min {policy.min_replicas})"),
                         phase=RUNNING, reason="NoticeScaledDown", handled=handled,
                         reclaims_survived=rec.reclaims_survived + 1)
        return c.act(SUSPEND, event=names.EVENT_SUSPENDED, key=decision_key("suspend", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: only {target} replicas on unaffected nodes, below "
                              f"min {policy.min_replicas}; suspending until capacity returns"),
                     phase=SUSPENDED, reason="BelowMin", handled=handled, replicas=state.replicas, waiting_since=c.now,
                     lacking_since=c.now)

    def when_running(self, c: Context) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        desired = min(policy.max_replicas, state.healthy_replicas + state.free_slots)
        if desired <= state.replicas:
            return c.stay()
        ready_at = (rec.decided_at or c.now) + timedelta(seconds=c.settings.scale_out_delay)
        if rec.decided_at is not None and c.now < ready_at:
            return c.stay(ready_at)
        return c.act(SCALE, event=names.EVENT_SCALED, replicas=desired,
                     key=decision_key("scale-out", c.previous, desired),
                     message=(f"capacity returned: scaling out from {state.replicas} to {desired}"
                              f" (max {policy.max_replicas})"),
                     phase=RUNNING, reason="CapacityReturned")


class FixedStrategy(Strategy):
    """Wait for the checkpoint, suspend, resume at full size."""

    def resume_need(self, c: Context) -> int:
        return c.rec.replicas or c.policy.max_replicas

    def resume_target(self, c: Context, need: int, slots: int) -> int:
        return need

    def on_notices(self, c: Context, new: list[NoticeHit]) -> Decision:
        rec, now = c.rec, c.now
        ids, nodes, handled = notice_facts(rec, new)
        awaited = {n.id: (n.node if n.from_node else "") for n in new}
        if rec.phase == CHECKPOINTING:
            return c.act(RECORD, event=names.EVENT_NOTED, key=decision_key("noted", *ids),
                         message=f"further notice on {nodes} while waiting for the checkpoint", handled=handled,
                         recheck_at=rec.checkpoint_deadline, awaiting={**(rec.awaiting or {}), **awaited})
        deadlines = [n.deadline for n in new if n.deadline is not None]
        deadline = min(deadlines) if deadlines else now + timedelta(seconds=c.settings.checkpoint_timeout)
        return c.act(RECORD, event=names.EVENT_CHECKPOINTING, key=decision_key("checkpoint", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: waiting for the checkpoint (a replica exits "
                              f"{names.EXIT_PREEMPTED}/{names.EXIT_CHECKPOINT_FAILED}) until "
                              f"{deadline.isoformat()}, then suspending"),
                     recheck_at=deadline, phase=CHECKPOINTING, reason="NoticeReceived", handled=handled,
                     checkpoint_deadline=deadline, replicas=c.state.replicas, lacking_since=rec.lacking_since or now,
                     awaiting=awaited)


class InPlaceStrategy(ElasticStrategy):
    """Elastic, membership changed in place: a notice changes no replica count. The ranks on the
    noticed node hand over and exit 83 by themselves, the survivors re-form without waiting,
    and the Job controller (podFailurePolicy Ignore on 83) or the training operator replaces
    the pod, which joins once Ready (membership_plan.py). Below min: suspend, as elastic."""

    def on_notices(self, c: Context, new: list[NoticeHit]) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        survivors = min(state.healthy_replicas, policy.max_replicas)
        if survivors < policy.min_replicas:
            return super().on_notices(c, new)
        ids, nodes, handled = notice_facts(rec, new)
        return c.act(RECORD, event=names.EVENT_LEAVING_IN_PLACE, key=decision_key("in-place", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: the replicas there leave in place, the "
                              f"{survivors} on unaffected nodes keep training (min {policy.min_replicas}); "
                              f"replacements join when capacity allows"),
                     phase=RUNNING, reason="NoticeLeavingInPlace", handled=handled,
                     reclaims_survived=rec.reclaims_survived + 1)


STRATEGIES: dict[str, Strategy] = {ELASTIC: ElasticStrategy(), FIXED: FixedStrategy()}
IN_PLACE = InPlaceStrategy()


def strategy_of(policy: Policy) -> Strategy:
    """The strategy of `policy`."""
    return IN_PLACE if policy.in_place else STRATEGIES[policy.mode]


def notice_facts(rec: Record, new: list[NoticeHit]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(the new notices' ids, their nodes as text, the handled ids with them added)."""
    ids = tuple(n.id for n in new)
    return ids, ", ".join(sorted({n.node for n in new})), rec.handled_add(*ids)
