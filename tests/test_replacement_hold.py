"""The hold before leave as pure units: `replacement_hold.release_at`, the notice gate's
replacement hold (release, re-offer, withdrawal, two notices, the horizon first), the
membership's `standby` flag on the wire and in the rank's view. No process, no clock."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spotguard.hooks.elastic.membership_view import MembershipView
from spotguard.hooks.notice_gate import Action, NoticeGate
from spotguard.hooks.replacement_hold import release_at
from spotguard.wire.membership import Membership, MembershipFormatError
from spotguard.wire.notice import Notice

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
T = NOW.timestamp()


def notice(nid: str, seconds: float | None = 10.0, node: str = "n1", kind: str = "reclaim") -> Notice:
    return Notice(id=nid, kind=kind, source="aws.spot", node=node, detected_at=NOW,
                  deadline=None if seconds is None else NOW + timedelta(seconds=seconds))


# ---- the decision ------------------------------------------------------------------------------
def hold(deadline: float | None = T + 10, coming: bool = True, estimate: float | None = 0.5,
         step: float = 0.1, margin: float = 2.0) -> float | None:
    return release_at(now=T, deadline=deadline, replacement_coming=coming, save_estimate=estimate,
                      step_seconds=step, margin_seconds=margin)


def test_the_hold_lasts_until_the_checkpoint_still_fits_before_the_deadline():
    assert hold() == pytest.approx(T + 10 - 0.5 - 0.1 - 2.0)


def test_without_a_replacement_coming_or_a_deadline_the_notice_is_acted_on_now():
    assert hold(coming=False) is None
    assert hold(deadline=None) is None


def test_a_deadline_too_short_to_hold_is_acted_on_now():
    assert hold(deadline=T + 2.6) is None  # the safe moment would be now
    assert hold(deadline=T + 1.0) is None
    assert hold(deadline=T + 2.7) == pytest.approx(T + 0.1)


def test_a_rank_that_never_measured_a_save_does_not_hold():
    assert hold(estimate=None) is None
    assert hold(step=5.0, estimate=3.0) is None  # long steps and saves: no room to hold


# ---- the gate ----------------------------------------------------------------------------------
class Holds:
    """The gate's `hold` callable: release `margin` seconds before each notice's deadline while
    `coming` (what the Guard computes from its view, adapter and step time)."""

    def __init__(self, margin: float = 3.0):
        self.coming, self.margin, self.asked = True, margin, 0

    def __call__(self, n: Notice, now: datetime) -> float | None:
        self.asked += 1
        return release_at(now=now.timestamp(), deadline=n.deadline.timestamp() if n.deadline else None,
                          replacement_coming=self.coming, save_estimate=0.0, step_seconds=0.0,
                          margin_seconds=self.margin)


def test_the_gate_holds_a_notice_until_its_release_time():
    gate = NoticeGate(hold=Holds())
    decision = gate.offer(notice("a"), NOW)
    assert (decision.action, decision.why, decision.release_ts) == (Action.HOLD, "replacement", T + 7)
    assert gate.pending is None and gate.holding
    assert gate.release_due(NOW + timedelta(seconds=6.9)) == [] and gate.pending is None
    assert [n.id for n in gate.release_due(NOW + timedelta(seconds=7))] == ["a"]
    assert gate.pending.id == "a" and not gate.holding


def test_a_copy_offered_again_never_moves_the_release_later():
    holds = Holds()
    gate = NoticeGate(hold=holds)
    gate.offer(notice("a", seconds=10), NOW)
    decision = gate.offer(notice("a", seconds=20), NOW + timedelta(seconds=1))  # a later deadline: still T + 7
    assert (decision.action, decision.release_ts) == (Action.HOLD, T + 7)
    decision = gate.offer(notice("a", seconds=8), NOW + timedelta(seconds=1))  # an earlier one: earlier
    assert (decision.action, decision.release_ts) == (Action.HOLD, T + 5)
    holds.coming = False  # the replacement is not coming any more: the next copy is acted on
    assert gate.offer(notice("a", seconds=8), NOW + timedelta(seconds=2)).action is Action.ACT
    assert gate.pending.id == "a" and not gate.holding


def test_without_a_replacement_or_with_too_short_a_deadline_the_gate_acts_at_once():
    holds = Holds()
    holds.coming = False
    assert NoticeGate(hold=holds).offer(notice("a"), NOW).action is Action.ACT
    gate = NoticeGate(hold=Holds())
    assert gate.offer(notice("b", seconds=2.0), NOW).action is Action.ACT and gate.pending.id == "b"
    assert gate.offer(notice("c", kind="gpu-fault", seconds=None), NOW).action is Action.ACT


def test_a_withdrawn_held_notice_is_never_acted_on():
    gate = NoticeGate(hold=Holds())
    gate.offer(notice("a"), NOW)
    assert gate.withdraw("a") == ("held",)
    assert gate.release_due(NOW + timedelta(seconds=30)) == [] and gate.pending is None and not gate.holding


def test_two_held_notices_are_released_each_at_its_own_time():
    gate = NoticeGate(hold=Holds())
    gate.offer(notice("a", seconds=10), NOW)
    gate.offer(notice("b", seconds=12, node="n2"), NOW)
    assert [n.id for n in gate.release_due(NOW + timedelta(seconds=7.5))] == ["a"] and gate.pending.id == "a"
    gate.answered("a")  # the drain of a ran
    assert gate.pending is None and gate.holding
    assert [n.id for n in gate.release_due(NOW + timedelta(seconds=9))] == ["b"] and gate.pending.id == "b"


def test_a_notice_the_horizon_releases_is_then_held_for_its_replacement():
    holds = Holds()
    gate = NoticeGate(horizon_seconds=60, hold=holds)
    assert gate.offer(notice("m", seconds=100, kind="maintenance"), NOW).why == "new"
    assert [n.id for n in gate.release_due(NOW + timedelta(seconds=40))] == ["m"]
    assert gate.pending is None and gate.holding  # within the horizon now, and its replacement is coming
    assert [n.id for n in gate.release_due(NOW + timedelta(seconds=97))] == ["m"] and gate.pending.id == "m"


# ---- the flag on the wire and in the view ------------------------------------------------------
def test_the_standby_flag_rides_the_membership():
    m = Membership(3, ("a", "b"), 2, store="127.0.0.1:29500", standby=True)
    assert Membership.from_json(m.to_json()) == m and m.to_wire()["standby"] is True
    assert "standby" not in Membership(3, ("a",), 1).to_wire()
    with pytest.raises(MembershipFormatError, match=r"^standby:"):
        Membership.from_wire({**m.to_wire(), "standby": "yes"})


def test_the_view_takes_the_flag_from_every_membership_it_takes():
    view = MembershipView("a")
    view.hosts = ("a", "b")
    view.offer(Membership(1, ("a", "b"), 2, store="127.0.0.1:1", standby=True).to_wire())
    assert view.standby and view.generation == 1 and view.pending_notice() is None
    view.offer(Membership(2, ("a", "c"), 2, store="127.0.0.1:1").to_wire())  # pending, without the flag
    assert not view.standby and view.pending_notice() is not None
