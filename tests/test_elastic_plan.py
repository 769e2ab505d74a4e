"""The pure parts of in-place membership changes (no processes): the re-form plan, the rank's
membership view (which pushed memberships become pending, which agreed notice changes the group),
and the agreement arithmetic with a membership pseudo-notice."""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest

from spotguard.hooks.agreement.base import agreed_membership, contribution, outcome
from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, Change, MembershipView, Settled
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, now_utc

STORE = "127.0.0.1:29400"


def notice(kind: Kind, node: str, source: str = "aws.spot", seconds: float | None = 120) -> Notice:
    now = now_utc()
    deadline = None if seconds is None else now + timedelta(seconds=seconds)
    return Notice(f"{source}:{node}", kind, source, node, now, deadline)


# ---- ReformPlan ---------------------------------------------------------------------------------
def test_shrink_plan_drops_the_leaving_host_and_renumbers_the_rest():
    plan = ReformPlan.make(["a", "b", "c"], ["b", "c"])
    assert (plan.old_world_size, plan.new_world_size, plan.leaving_hosts, plan.joining_hosts) == (3, 2, ("a",), ())
    assert [plan.new_rank(r) for r in range(3)] == [None, 0, 1] and plan.leaves(0) and not plan.leaves(1)
    assert plan.survivors == (1, 2) and plan.leader_old_rank == 1 and plan.first_survivor_old_rank == 1
    assert [plan.survivor_rank(r) for r in (1, 2)] == [0, 1] and plan.changes


def test_grow_plan_places_joiners_and_a_joining_leader_has_no_old_rank():
    grow = ReformPlan.make(["b", "c"], ["b", "c", "d"])
    assert grow.joining_hosts == ("d",) and grow.joiner_rank("d", 0) == 2 and grow.leader_old_rank == 0
    led_by_joiner = ReformPlan.make(["b"], ["d", "b"])
    assert led_by_joiner.leader_old_rank is None and led_by_joiner.new_rank(0) == 1
    assert led_by_joiner.survivor_rank(0) == 0  # the fallback group is the survivors alone
    with pytest.raises(ValueError):
        grow.joiner_rank("e", 0)


def test_plan_with_several_processes_per_host():
    plan = ReformPlan.make(["a", "b"], ["b", "c"], procs_per_host=2)
    assert [plan.new_rank(r) for r in range(4)] == [None, None, 0, 1]
    assert plan.joiner_rank("c", 1) == 3 and plan.leader_old_rank == 2 and plan.survivors == (2, 3)


def test_same_hosts_in_another_order_is_no_change():
    assert not ReformPlan.make(["a", "b"], ["b", "a"]).changes


@pytest.mark.parametrize("old, target, procs", [(["a"], [], 1), (["a", "a"], ["a"], 1), (["a"], ["b", "b"], 1),
                                                (["a"], ["b"], 0)])
def test_plan_rejects_impossible_groups(old, target, procs):
    with pytest.raises(ValueError):
        ReformPlan.make(old, target, procs)


# ---- MembershipView -----------------------------------------------------------------------------
def view_of(hosts=("a", "b", "c"), node="b", min_world_size=1) -> MembershipView:
    view = MembershipView(node, min_world_size=min_world_size)
    view.hosts = tuple(hosts)
    return view


def membership(generation: int, hosts, store: str = STORE) -> dict:
    data = {"v": 1, "generation": generation, "hosts": list(hosts), "world_size": len(hosts)}
    if store:
        data["store"] = store
    return data


def test_a_newer_membership_with_other_hosts_becomes_a_membership_notice():
    view = view_of()
    view.offer(membership(2, ["b", "c", "d"]))
    pending = view.pending_notice()
    assert pending is not None and pending.source == MEMBERSHIP_SOURCE and pending.kind is Kind.DRAIN
    assert pending.node == "b" and pending.deadline is None
    change = view.plan_for(pending, step=7)
    assert change is not None and change.plan.target_hosts == ("b", "c", "d")
    assert (change.prefix, change.store, change.generation, change.reason) == ("m2/", STORE, 2, "membership")
    view.adopt(2)  # the Guard after the change: nothing stays pending
    assert view.pending_notice() is None


def test_older_equal_storeless_and_malformed_memberships_leave_nothing_pending():
    view = view_of()
    view.offer(membership(3, ["c", "b", "a"]))  # the group's own hosts: the supervisor confirming
    assert view.pending_notice() is None and view.generation == 3
    view.offer(membership(2, ["b", "c", "d"]))  # older than what was seen
    assert view.pending_notice() is None and view.generation == 3
    view.offer(membership(4, ["b", "c", "d"], store=""))  # not an in-place membership
    assert view.pending_notice() is None
    for junk in ({"v": 1, "generation": "x", "hosts": ["b"], "world_size": 1}, {"v": 9}, "not a dict"):
        view.offer(junk)  # type: ignore[arg-type]
    assert view.pending_notice() is None
    view.offer(membership(5, ["b", "d"]))
    assert view.pending_notice() is not None  # still listening after the junk


def test_a_notice_naming_a_host_of_the_group_shrinks_it_by_that_host():
    change = view_of().plan_for(notice(Kind.RECLAIM, "a"), step=4)
    assert change is not None and change.plan.target_hosts == ("b", "c")
    assert (change.store, change.generation, change.reason) == ("", -1, "reclaim")
    assert change.prefix == "s4-2/"  # the step and the new size: the same on every rank


@pytest.mark.parametrize("agreed", [
    notice(Kind.DRAIN, "a", source=names.SUPERVISOR_DRAIN_SOURCE, seconds=None),  # the whole job drains
    notice(Kind.RECLAIM, "z"),  # a host that is not in the group
])
def test_notices_that_drain_everyone(agreed):
    assert view_of().plan_for(agreed, step=4) is None


def test_a_shrink_below_min_world_size_drains_everyone():
    assert view_of(min_world_size=3).plan_for(notice(Kind.RECLAIM, "a"), step=4) is None
    assert view_of(min_world_size=2).plan_for(notice(Kind.RECLAIM, "a"), step=4) is not None


def test_without_known_hosts_nothing_changes_in_place():
    assert MembershipView("b").plan_for(notice(Kind.RECLAIM, "a"), step=1) is None


# ---- the agreement with a membership pseudo-notice ----------------------------------------------
def combine(contributions):
    return [max(column) for column in zip(*contributions)]


def test_a_real_notice_at_a_higher_rank_wins_over_a_membership_at_rank_0():
    world = 4
    combined = combine([contribution(notice(Kind.RECLAIM, "c", seconds=60) if rank == 2 else None, rank, world,
                                     5 if rank == 0 else None) for rank in range(world)])
    deadline, source = outcome(combined, world)
    assert source == 2 and abs(deadline - (time.time() + 60)) < 5
    assert agreed_membership(combined, world) == (5, 0)  # its own field: still there for a later boundary


def test_a_membership_alone_is_agreed_from_the_lowest_rank_holding_it():
    world = 3
    combined = combine([contribution(None, rank, world, 5 if rank else None) for rank in range(world)])
    assert outcome(combined, world) is None and agreed_membership(combined, world) == (5, 1)
    assert agreed_membership(combine([contribution(None, r, world) for r in range(world)]), world) is None


def _membership_notice() -> Notice:
    view = view_of()
    view.offer(membership(1, ["b", "c", "d"]))
    pending = view.pending_notice()
    assert pending is not None
    return pending


def test_every_rank_computes_the_same_shrink_prefix_whatever_its_history():
    """A joiner has formed fewer groups than the ranks that were there from the start; the
    group a shrink forms must still meet under one prefix (a 4-worker replay timed out on it)."""
    veteran, joiner = view_of(node="a"), view_of(node="c")
    veteran.formations, joiner.formations = 3, 1
    reclaim = notice(Kind.RECLAIM, "b")
    assert veteran.plan_for(reclaim, step=224).prefix == joiner.plan_for(reclaim, step=224).prefix
    assert veteran.plan_for(reclaim, step=224).prefix != veteran.plan_for(reclaim, step=225).prefix


# ---- a pending membership after a change (issue 18, item 4) -------------------------------------
def changed(view: MembershipView, old_hosts, new_hosts, started_at: float | None = None) -> None:
    """What the Guard does after a change this rank continues from: the new group, then the re-check."""
    view.hosts = tuple(new_hosts)
    view.after_change(ReformPlan.make(old_hosts, new_hosts), time.time() if started_at is None else started_at)


@pytest.mark.parametrize("pending_hosts, change_to, offered, kept, generation", [
    # (a) all four listed, SIGTERM took d out: the stale membership would re-add d
    (["a", "b", "c", "d"], ["a", "b", "c"], "before", False, 5),
    # ... unless it came after the change began: then it is the supervisor's newer word
    (["a", "b", "c", "d"], ["a", "b", "c"], "after", True, 4),
    # (b) the pending membership is the group the change formed: only its generation
    (["a", "b"], ["a", "b"], "before", False, 5),
    (["b", "a"], ["a", "b"], "after", False, 5),
    # a grow pending while another host left: still a change to make
    (["a", "b", "e"], ["a", "b"], "before", True, 4),
])
def test_a_pending_membership_is_rechecked_after_a_change(pending_hosts, change_to, offered, kept, generation):
    view = view_of(("a", "b", "c", "d"))
    view.generation = 4
    started = time.time()
    if offered == "after":
        started -= 60
    else:
        view.offer(membership(5, pending_hosts))
    old = view.hosts
    changed(view, old, change_to, started_at=started if offered == "after" else time.time() + 1)
    if offered == "after":
        view.offer(membership(5, pending_hosts))
    assert (view.pending_notice() is not None, view.generation) == (kept, generation)


def test_an_agreed_membership_equal_to_the_group_settles_instead_of_draining_everyone():
    view = view_of(("a", "b", "c"))
    view.offer(membership(5, ["a", "b", "c", "d"]))
    pending = view.pending_notice()
    assert pending is not None
    view.hosts = ("a", "b", "c", "d")  # another rank's view formed it meanwhile: the agreed notice asks nothing
    assert view.plan_for(pending, step=9) == Settled(5, "the group already has its hosts")


def test_an_agreed_membership_written_before_its_host_left_settles():
    view = view_of(("a", "b", "c", "d"))
    view.offer(membership(5, ["a", "b", "c", "d", "e"]))
    pending = view.pending_notice()
    changed(view, ("a", "b", "c", "d"), ("a", "b", "c"), started_at=time.time() + 1)
    assert view.pending_notice() is None
    settled = view.plan_for(pending, step=9)  # a rank that still held it contributed it
    assert isinstance(settled, Settled) and "before d left" in settled.why
    again = view_of(("a", "b", "c"))
    again.offer(membership(6, ["a", "b", "c", "d"]))  # a newer one naming d: d came back
    assert isinstance(again.plan_for(again.pending_notice(), step=10), Change)


# ---- bad input: refused with one line naming the field ------------------------------------------
@pytest.mark.parametrize("data, field", [
    ({"v": 1, "generation": 6, "hosts": ["b", "c", "c"], "world_size": 3, "store": STORE}, "hosts"),
    (membership(6, ["b", "c", "d"], store=""), "store"),
    (membership(3, ["b", "c", "d"]), "generation"),
])
def test_bad_memberships_are_refused_with_one_line_naming_the_field(data, field, caplog):
    view = view_of()
    view.generation = 4
    with caplog.at_level(logging.WARNING, logger="spotguard.hooks.elastic"):
        view.offer(data)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "refused" in lines[0] and f"{field}:" in lines[0], lines
    assert view.pending_notice() is None and view.generation == 4
    view.offer(membership(7, ["b", "c", "d"]))  # the next good one is taken
    assert view.pending_notice() is not None


def test_a_membership_sent_again_logs_nothing(caplog):
    view = view_of()
    view.offer(membership(5, ["b", "c", "d"]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="spotguard.hooks.elastic"):
        view.offer(membership(5, ["b", "c", "d"]))
    assert caplog.records == [] and view.pending_notice() is not None
