"""The Guard's decisions as pure units: the notice gate, the agreement's outcome, the save decision.

No process group, no clock: time is passed in; several ranks are simulated by the element-wise
maximum the all_reduce(MAX) computes.
"""
from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta, UTC

from spotguard.hooks.agreement import make_agreement
from spotguard.hooks.agreement.base import contribution, outcome
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.notice_gate import Action, NoticeGate
from spotguard.hooks.save_decision import SaveChoice, decide, vote
from spotguard.wire.notice import Kind, Notice, Severity

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def notice(nid: str, seconds: float | None = 60.0, kind: str = "reclaim") -> Notice:
    return Notice(id=nid, kind=kind, source="aws.spot", node="n1", detected_at=NOW,
                  deadline=None if seconds is None else NOW + timedelta(seconds=seconds))


def reduce_max(*votes: list[float]) -> list[float]:
    """What one all_reduce(MAX) gives every rank."""
    return [max(column) for column in zip(*votes)]


# ---- the notice gate --------------------------------------------------------------------------
def test_gate_never_acts_on_an_advisory():
    gate = NoticeGate(horizon_seconds=120)
    for seconds in (0.0, 60.0, None, 3600.0):  # due now, soon, no deadline, beyond the horizon
        advisory = replace(notice(f"adv-{seconds}", seconds=seconds, kind="gpu-fault"), severity=Severity.ADVISORY)
        decision = gate.offer(advisory, NOW)
        assert (decision.action, decision.why) == (Action.IGNORE, "advisory")
    assert gate.pending is None and not gate.holding
    assert gate.release_due(NOW + timedelta(hours=2)) == [] and gate.pending is None


def test_gate_ignores_kinds_not_acted_on_and_answered_ids():
    gate = NoticeGate(horizon_seconds=120)
    assert gate.offer(notice("r", kind="rebalance"), NOW).action is Action.IGNORE
    assert gate.pending is None
    assert gate.offer(notice("a"), NOW).action is Action.ACT and gate.pending.id == "a"
    gate.answered("a")
    assert gate.pending is None
    decision = gate.offer(notice("a", seconds=10), NOW)  # an updated copy of an answered notice
    assert (decision.action, decision.why) == (Action.IGNORE, "answered") and gate.pending is None
    only_drains = NoticeGate(act_on={Kind.DRAIN})
    assert only_drains.offer(notice("x"), NOW).why == "kind"
    assert only_drains.offer(notice("d", kind="drain"), NOW).action is Action.ACT


def test_gate_keeps_the_most_urgent_notice():
    gate = NoticeGate()
    gate.offer(notice("late", seconds=90), NOW)
    gate.offer(notice("soon", seconds=20), NOW)
    gate.offer(notice("later", seconds=100), NOW)  # acted on, but not more urgent
    assert gate.pending.id == "soon"
    gate.offer(notice("none", seconds=None), NOW)  # no deadline: the least urgent of all
    assert gate.pending.id == "soon"
    gate.offer(notice("soon", seconds=110), NOW)  # an update replaces it: "late" is now the most urgent
    assert gate.pending.id == "late"
    gate.withdraw("late")
    gate.withdraw("later")
    assert (gate.pending.id, gate.pending.deadline) == ("soon", NOW + timedelta(seconds=110))


def test_gate_a_later_notice_waits_behind_the_pending_one_and_follows_it():
    """Two notices to act on (a reclaim, then a maintenance due later, on the same node): the
    earlier is withdrawn, or answered by a change this rank stays through, and the later one is
    pending next. It was dropped when it came: the stream sends a notice once, so it never came
    back, and its deadline passed unanswered."""
    gate = NoticeGate()
    gate.offer(notice("reclaim", seconds=30), NOW)
    gate.offer(notice("maintenance", seconds=100, kind="maintenance"), NOW)
    gate.offer(notice("gpu", seconds=110, kind="gpu-fault"), NOW)
    assert gate.pending.id == "reclaim"
    assert gate.withdraw("reclaim") == ("pending",)
    assert gate.pending.id == "maintenance"
    gate.answered("maintenance")
    assert gate.pending.id == "gpu"
    assert gate.withdraw("gpu") == ("pending",) and gate.pending is None


def test_gate_holds_beyond_the_horizon_and_releases_when_due():
    gate = NoticeGate(horizon_seconds=120)
    first = gate.offer(notice("m", seconds=3600, kind="maintenance"), NOW)
    assert (first.action, first.why, first.seconds_left) == (Action.HOLD, "new", 3600)
    assert gate.offer(notice("m", seconds=3600, kind="maintenance"), NOW).why == "again"
    assert gate.pending is None and gate.holding and gate.held_ids() == {"m"}
    assert gate.release_due(NOW + timedelta(seconds=3400)) == []  # still 200 s away
    released = gate.release_due(NOW + timedelta(seconds=3480))  # 120 s away: within the horizon
    assert [n.id for n in released] == ["m"]
    assert gate.pending.id == "m" and not gate.holding


def test_gate_withdrawal_drops_held_and_pending_notices():
    gate = NoticeGate(horizon_seconds=120)
    gate.offer(notice("far", seconds=600), NOW)
    gate.offer(notice("near", seconds=30), NOW)
    assert gate.withdraw("far") == ("held",) and not gate.holding
    assert gate.withdraw("near") == ("pending",) and gate.pending is None
    assert gate.withdraw("unknown") == ()
    assert gate.release_due(NOW + timedelta(seconds=600)) == []  # a withdrawn hold never comes back


# ---- the agreement ----------------------------------------------------------------------------
def test_agreement_outcome_is_the_earliest_deadline_and_the_lowest_rank_holding_a_notice():
    world = 4
    soon, late = notice("soon", seconds=30), notice("late", seconds=90)
    flags = [contribution(None, 0, world), contribution(late, 1, world), contribution(soon, 2, world),
             contribution(soon, 3, world)]
    deadline, source_rank = outcome(reduce_max(*flags), world)
    # the elements reduce independently: rank 1 (the lowest holding any notice) speaks for all,
    # with the earliest deadline any rank holds
    assert deadline == soon.deadline.timestamp() and source_rank == 1
    assert outcome(reduce_max(*(contribution(None, r, world) for r in range(world))), world) is None
    undated = outcome(reduce_max(contribution(None, 0, 2), contribution(notice("u", seconds=None), 1, 2)), 2)
    assert undated == (math.inf, 1)


def test_local_agreement_acts_on_a_pending_notice_at_once():
    agreement = make_agreement(Collectives(), agree_every=5)  # a process alone: no collective at all
    assert agreement.at_boundary(3, None) is None
    verdict = agreement.at_boundary(3, notice("a", seconds=45))  # not a multiple of agree_every: still now
    assert (verdict.pending.id, verdict.source_rank, verdict.deadline_ts) == (
        "a", 0, (NOW + timedelta(seconds=45)).timestamp())


# ---- the save decision ------------------------------------------------------------------------
def test_save_decision_fresh_when_time_allows_else_the_common_snapshot():
    assert decide(vote(60.0, 5.0, 1.0, snapshot_step=8)) is SaveChoice.FRESH
    assert decide(vote(None, 5.0, 1.0, snapshot_step=8)) is SaveChoice.FRESH  # no deadline: never too short
    assert decide(vote(5.5, 5.0, 1.0, snapshot_step=8)) is SaveChoice.SNAPSHOT  # 5.5 < 5 + 1
    assert decide(vote(0.5, None, 1.0, snapshot_step=8)) is SaveChoice.SNAPSHOT  # no measurement: margin only
    assert decide(vote(0.5, None, 1.0, snapshot_step=None)) is SaveChoice.NO_COMMON_SNAPSHOT


def test_save_decision_across_ranks():
    # one rank's estimate does not fit: every rank persists the common snapshot
    assert decide(reduce_max(vote(30, 2, 1, 8), vote(30, 40, 1, 8), vote(30, 2, 1, 8))) is SaveChoice.SNAPSHOT
    # snapshots of different steps (or one rank without any): a fresh save after all
    assert decide(reduce_max(vote(3, 5, 1, 8), vote(3, 5, 1, 4))) is SaveChoice.NO_COMMON_SNAPSHOT
    assert decide(reduce_max(vote(3, 5, 1, 8), vote(3, 5, 1, None))) is SaveChoice.NO_COMMON_SNAPSHOT
    assert decide(reduce_max(vote(30, 2, 1, 8), vote(30, 2, 1, None))) is SaveChoice.FRESH
