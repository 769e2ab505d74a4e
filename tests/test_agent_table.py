"""The live notice table: dedupe across origins, earliest deadline, moves, withdrawals, fan-out."""
from __future__ import annotations

from datetime import datetime, timedelta, UTC

from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.agent.table import NoticeTable
from spotguard.wire.notice import Kind, Notice
from spotguard.wire.withdrawal import Withdrawal

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def notice(nid: str = "aws.spot:1", deadline_s: float | None = 120, source: str = "aws.spot",
           detected_s: float = 0, kind: Kind = Kind.RECLAIM) -> Notice:
    return Notice(id=nid, kind=kind, source=source, node="n1", detected_at=T0 + timedelta(seconds=detected_s),
                  deadline=None if deadline_s is None else T0 + timedelta(seconds=deadline_s))


def test_same_id_from_two_origins_is_published_once_with_the_earliest_deadline():
    table = NoticeTable("n1")
    first = table.apply("a", notice(deadline_s=120))
    assert [p.change.deadline for p in first] == [T0 + timedelta(seconds=120)]
    assert table.apply("b", notice(deadline_s=300, detected_s=1)) == []  # later deadline: nothing new
    moved = table.apply("b", notice(deadline_s=60, detected_s=1))  # earlier deadline wins
    assert [p.change.deadline for p in moved] == [T0 + timedelta(seconds=60)]
    assert len(table.live()) == 1
    assert table.live()[0].detected_at == T0  # first detection kept
    assert [p.seq for p in first + moved] == [1, 2]


def test_moved_deadline_updates_and_identical_report_changes_nothing():
    table = NoticeTable("n1")
    table.apply("a", notice(deadline_s=120))
    assert table.apply("a", notice(deadline_s=120, detected_s=5)) == []
    later = table.apply("a", notice(deadline_s=600))
    assert [p.change.deadline for p in later] == [T0 + timedelta(seconds=600)]
    assert table.get("aws.spot:1").deadline == T0 + timedelta(seconds=600)


def test_no_deadline_sorts_last_and_never_beats_a_deadline():
    table = NoticeTable("n1")
    table.apply("a", notice("x:1", deadline_s=None, kind=Kind.REBALANCE))
    table.apply("a", notice("x:2", deadline_s=30))
    assert [n.id for n in table.live()] == ["x:2", "x:1"]
    table.apply("b", notice("x:2", deadline_s=None))
    assert table.get("x:2").deadline == T0 + timedelta(seconds=30)


def test_withdrawn_only_when_every_origin_withdrew():
    table = NoticeTable("n1")
    table.apply("a", notice(deadline_s=60))
    table.apply("b", notice(deadline_s=120))
    back = table.apply("a", Withdrawal("aws.spot:1", "aws.spot", "n1", "canceled"))
    assert [p.change.deadline for p in back] == [T0 + timedelta(seconds=120)]  # b's report remains
    gone = table.apply("b", Withdrawal("aws.spot:1", "aws.spot", "n1", "canceled"))
    assert len(gone) == 1 and isinstance(gone[0].change, Withdrawal)
    assert gone[0].change.notice_id == "aws.spot:1" and gone[0].change.reason == "canceled"
    assert table.live() == []
    assert table.apply("b", Withdrawal("aws.spot:1", "aws.spot", "n1")) == []  # twice: no-op


def test_withdrawal_from_an_origin_that_never_reported_is_ignored():
    table = NoticeTable("n1")
    table.apply("a", notice())
    assert table.apply("z", Withdrawal("aws.spot:1", "aws.spot", "n1")) == []
    assert len(table.live()) == 1


async def test_subscribers_get_snapshot_then_changes_without_gap_or_overlap():
    table = NoticeTable("n1")
    table.apply("a", notice("x:1"))
    sub = table.subscribe()
    assert [n.id for n in sub.snapshot] == ["x:1"] and sub.seq == 1
    table.apply("a", notice("x:2"))
    table.apply("a", Withdrawal("x:1", "aws.spot", "n1"))
    got = [await sub.next(timeout=1), await sub.next(timeout=1)]
    assert [p.seq for p in got] == [2, 3]
    assert got[0].change.id == "x:2" and got[1].change.notice_id == "x:1"
    table.close()
    assert await sub.next(timeout=1) is None
    assert table.subscriber_count == 0


async def test_slow_subscriber_is_cut_off_not_buffered_forever():
    table = NoticeTable("n1", max_backlog=3)
    slow = table.subscribe()
    for i in range(5):
        table.apply("a", notice(f"x:{i}"))
    assert slow.overflowed and slow.closed
    for _ in range(3):
        assert (await slow.next(timeout=1)) is not None
    assert await slow.next(timeout=1) is None
    assert table.subscriber_count == 0
    fresh = table.subscribe()  # reconnecting: the snapshot has everything
    assert len(fresh.snapshot) == 5


def test_a_failing_listener_does_not_stop_publishing():
    table = NoticeTable("n1")
    seen = []

    def broken(published):
        raise RuntimeError("boom")

    table.add_listener(broken)
    table.add_listener(seen.append)
    table.apply("a", notice())
    assert len(seen) == 1 and len(table.live()) == 1


def test_closed_table_ignores_updates():
    table = NoticeTable("n1")
    table.close()
    assert table.apply("a", notice()) == []
    sub = table.subscribe()
    assert sub.closed


# -- property: the table agrees with a simple model of "earliest deadline over live reports" ----

ops = st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["x:1", "x:2"]),
                         st.one_of(st.none(), st.integers(0, 5))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_table_matches_model(operations):
    table = NoticeTable("n1")
    model: dict[str, dict[str, int | None]] = {}
    replayed: dict[str, Notice] = {}
    for origin, nid, deadline in operations:
        if deadline is None:
            changes = table.apply(origin, Withdrawal(nid, "aws.spot", "n1"))
            model.get(nid, {}).pop(origin, None)
        else:
            changes = table.apply(origin, notice(nid, deadline_s=deadline * 10))
            model.setdefault(nid, {})[origin] = deadline * 10
        for p in changes:  # a consumer applying the stream ends up with the table's view
            if isinstance(p.change, Notice):
                replayed[p.change.id] = p.change
            else:
                replayed.pop(p.change.notice_id)
    expected = {nid: min(reports.values()) for nid, reports in model.items() if reports}
    assert {n.id: (n.deadline - T0).total_seconds() for n in table.live()} == expected
    assert replayed == {n.id: n for n in table.live()}


async def test_attached_sink_gets_queued_changes_first_then_each_change_synchronously():
    from spotguard.agent.table import TICK

    table = NoticeTable("n1")
    sub = table.subscribe()
    table.apply("a", notice("x:1"))  # queued before the sink is attached
    got: list = []
    sub.attach(lambda item: got.append(item))
    table.apply("a", notice("x:2"))
    table.tick()
    assert [p.seq for p in got[:2]] == [1, 2] and got[2] is TICK
    full = table.subscribe()
    full.attach(lambda item: "full")
    table.apply("a", notice("x:3"))
    assert full.overflowed and full.closed and await full.next(timeout=1) is None
    gone = table.subscribe()
    gone.attach(lambda item: "gone")
    table.apply("a", notice("x:4"))
    assert gone.closed and not gone.overflowed
    assert table.subscriber_count == 1
