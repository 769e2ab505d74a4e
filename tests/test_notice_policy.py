"""The one notice policy (`spotguard.wire.notice_policy`): what a notice means at a time, as a
table, and that the Guard's gate reads notices through it."""
from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest

from spotguard.hooks.notice_gate import Action, NoticeGate
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, Severity
from spotguard.wire.notice_policy import (DEPARTING_KINDS, HORIZON_SECONDS, Meaning, announces_departure,
                                          answered_by_standby, departs, next_release, read)

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def notice(kind: Kind, lead: float | None, *, source: str = "aws.spot", advisory: bool = False,
           nid: str = "n1") -> Notice:
    return Notice(nid, kind, source, "node-1", NOW,
                  deadline=None if lead is None else NOW + timedelta(seconds=lead),
                  severity=Severity.ADVISORY if advisory else Severity.ACT)


# (kind, seconds to the deadline (None: none), advisory, meaning, release after now (s) or None)
TABLE = [
    (Kind.RECLAIM, 120.0, False, Meaning.DEPARTURE, None),  # AWS's 2 minutes: acted on at once
    (Kind.RECLAIM, 30.0, False, Meaning.DEPARTURE, None),
    (Kind.RECLAIM, None, False, Meaning.DEPARTURE, None),  # no deadline: any moment
    (Kind.RECLAIM, -5.0, False, Meaning.DEPARTURE, None),  # past its deadline: still leaving
    (Kind.MAINTENANCE, 600.0, False, Meaning.HELD, 480.0),  # announced 10 minutes out: held 8 of them
    (Kind.MAINTENANCE, 120.5, False, Meaning.HELD, 0.5),
    (Kind.MAINTENANCE, 119.0, False, Meaning.DEPARTURE, None),
    (Kind.MAINTENANCE, None, False, Meaning.DEPARTURE, None),
    (Kind.RECLAIM, 3600.0, False, Meaning.HELD, 3480.0),  # any departing kind beyond the horizon is held
    (Kind.GPU_FAULT, 0.0, False, Meaning.DEPARTURE, None),
    (Kind.GPU_FAULT, None, True, Meaning.ADVICE, None),  # a GPU warning: information only
    (Kind.DRAIN, 30.0, False, Meaning.DEPARTURE, None),
    (Kind.REBALANCE, None, False, Meaning.ADVICE, None),  # a risk, not a departure
    (Kind.REBALANCE, 60.0, False, Meaning.ADVICE, None),
    (Kind.RECLAIM, 30.0, True, Meaning.ADVICE, None),  # advisory severity wins over the kind
]


@pytest.mark.parametrize("kind, lead, advisory, meaning, release_in", TABLE)
def test_the_table(kind, lead, advisory, meaning, release_in):
    reading = read(notice(kind, lead, advisory=advisory), NOW)
    assert reading.meaning is meaning
    assert reading.departs is (meaning is Meaning.DEPARTURE)
    if release_in is None:
        assert reading.release_at is None
    else:
        assert reading.release_at == NOW + timedelta(seconds=release_in)


@pytest.mark.parametrize("kind, lead, advisory, meaning, release_in", TABLE)
def test_a_notice_announces_a_departure_exactly_when_it_reads_as_one_at_some_time(kind, lead, advisory, meaning,
                                                                                  release_in):
    """The readers that follow which nodes are leaving, whenever (the in-place membership view,
    the sidecar's hostfile), ask `announces_departure`: held or departing in the table."""
    assert announces_departure(notice(kind, lead, advisory=advisory)) is (meaning is not Meaning.ADVICE)


def test_a_held_notice_departs_once_its_release_comes():
    far = notice(Kind.MAINTENANCE, 600.0)
    release = read(far, NOW).release_at
    assert release is not None and not departs(far, NOW)
    assert not departs(far, release - timedelta(microseconds=1))
    assert departs(far, release)


def test_a_reader_narrows_the_kinds_and_the_horizon():
    assert read(notice(Kind.MAINTENANCE, 30.0), NOW, departing={Kind.RECLAIM}).why == "kind"
    assert read(notice(Kind.REBALANCE, 30.0), NOW, departing=set(Kind)).meaning is Meaning.ADVICE  # never widened
    assert read(notice(Kind.MAINTENANCE, 600.0), NOW, horizon_seconds=900.0).departs


def test_next_release_is_the_earliest_held_one():
    held = [notice(Kind.MAINTENANCE, 600.0, nid="a"), notice(Kind.MAINTENANCE, 300.0, nid="b"),
            notice(Kind.RECLAIM, 30.0, nid="c"), None, notice(Kind.REBALANCE, 10.0, nid="d")]
    assert next_release(held, NOW) == NOW + timedelta(seconds=300.0 - HORIZON_SECONDS)
    assert next_release([notice(Kind.RECLAIM, 30.0)], NOW) is None


@pytest.mark.parametrize("kind, source, answered", [
    (Kind.RECLAIM, "aws.spot", True),
    (Kind.MAINTENANCE, "gcp.maintenance", True),
    (Kind.DRAIN, "k8s.node", True),
    (Kind.REBALANCE, "aws.rebalance", False),
    (Kind.DRAIN, names.SIGNAL_SOURCE, False),
    (Kind.DRAIN, names.SUPERVISOR_DRAIN_SOURCE, False),
    (Kind.DRAIN, names.MEMBERSHIP_SOURCE, False),
])
def test_which_notices_a_warm_standby_answers(kind, source, answered):
    assert answered_by_standby(notice(kind, 60.0, source=source)) is answered


@pytest.mark.parametrize("kind, lead, advisory, meaning, release_in", TABLE)
def test_the_guards_gate_reads_through_the_policy(kind, lead, advisory, meaning, release_in):
    gate = NoticeGate()
    action = gate.offer(notice(kind, lead, advisory=advisory), NOW).action
    assert action is {Meaning.ADVICE: Action.IGNORE, Meaning.HELD: Action.HOLD, Meaning.DEPARTURE: Action.ACT}[meaning]
    assert (gate.pending is not None) is (meaning is Meaning.DEPARTURE)


def test_departing_kinds_are_the_gates_default():
    assert NoticeGate().act_on == DEPARTING_KINDS


def test_the_departure_order_puts_first_what_departs_first_under_any_horizon():
    """For every horizon, the first notice in `departure_order` departs no later than any other
    of the set (a notice that never departs, an advisory or a risk, comes after every departing one)."""
    from spotguard.wire.notice_policy import departure_order, read

    t0 = datetime(2026, 11, 29, tzinfo=UTC)

    def notice(kind, lead, advisory=False, tag="x"):
        return Notice(id=f"s:{tag}", kind=kind, source="s", node="n", detected_at=t0,
                      deadline=None if lead is None else t0 + timedelta(seconds=lead),
                      severity=Severity.ADVISORY if advisory else Severity.ACT)

    notices = [notice(Kind.MAINTENANCE, 3600, tag="m1"), notice(Kind.MAINTENANCE, 300, tag="m2"),
               notice(Kind.RECLAIM, 50, advisory=True, tag="adv"), notice(Kind.REBALANCE, None, tag="r"),
               notice(Kind.GPU_FAULT, None, tag="g"), notice(Kind.RECLAIM, 120, tag="rc")]

    def departs_at(n, horizon):  # the first second from t0 at which n reads as a departure (None: never)
        return next((s for s in range(0, 4000, 10)
                     if read(n, t0 + timedelta(seconds=s), horizon_seconds=horizon).departs), None)

    for subset in (notices, notices[:3], notices[1:4], [notices[0], notices[2]], notices[2:4]):
        first = min(subset, key=departure_order)
        for horizon in (30.0, 120.0, 600.0, 7200.0):
            times = [departs_at(n, horizon) for n in subset]
            soonest = min((t for t in times if t is not None), default=None)
            assert departs_at(first, horizon) == soonest, (first.id, horizon, [n.id for n in subset])
