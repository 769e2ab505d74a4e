"""What an agreed notice asks of a group (`hooks/machine/decide.py`), pure: drain, settle or
resize, for every kind of notice and membership against a view of hosts a, b, c."""
from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest

from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, MembershipView
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.hooks.machine.decide import Drain, Resize, Settle, decide
from spotguard.wire import names
from spotguard.wire.membership import Membership
from spotguard.wire.notice import Kind, Notice, Severity

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
HOSTS = ("a", "b", "c")


def view(hosts=HOSTS, min_world=1, procs=1, departed_before: str | None = None) -> MembershipView:
    made = MembershipView("b", procs_per_host=procs, min_world_size=min_world)
    made.hosts = hosts
    if departed_before is not None:  # `departed_before` left the group 1 s after T0
        made.hosts = (*hosts, departed_before)
        made.after_change(ReformPlan.make(made.hosts, hosts), (T0 + timedelta(seconds=1)).timestamp())
        made.hosts = hosts
    return made


def notice(kind=Kind.RECLAIM, node="a", source="aws.spot", severity=Severity.ACT) -> Notice:
    return Notice("n-1", kind, source, node, T0, T0 + timedelta(seconds=60), {}, severity=severity)


def membership(generation: int, hosts: tuple[str, ...], offered=T0, store="10.0.0.9:29411") -> Notice:
    data = Membership(generation, hosts, len(hosts), store=store)
    return Notice(f"membership-{generation}", Kind.DRAIN, MEMBERSHIP_SOURCE, "b", offered, None,
                  {"membership": data.to_json(), "generation": generation})


def broken_membership() -> Notice:
    return Notice("membership-7", Kind.DRAIN, MEMBERSHIP_SOURCE, "b", T0, None, {"membership": "{", "generation": 7})


CASES = [
    # name, notice, view (None: not in place), resizable, expected
    ("not in place -> drain", notice(), None, True, Drain),
    ("an adapter that cannot resize -> drain", notice(), view(), False, Drain),
    ("reclaim of a host -> it leaves", notice(), view(), True, ("s5-2/", ("b", "c"), "", -1, "reclaim")),
    ("maintenance of a host -> it leaves", notice(Kind.MAINTENANCE, "c"), view(), True,
     ("s5-2/", ("a", "b"), "", -1, "maintenance")),
    ("GPU fault -> that host leaves", notice(Kind.GPU_FAULT, "b", "gpu"), view(), True,
     ("s5-2/", ("a", "c"), "", -1, "gpu-fault")),
    ("SIGTERM on a host -> it leaves", notice(Kind.DRAIN, "a", "signal"), view(), True,
     ("s5-2/", ("b", "c"), "", -1, "drain")),
    ("the supervisor drains the job -> drain", notice(Kind.DRAIN, "a", names.SUPERVISOR_DRAIN_SOURCE), view(), True,
     Drain),
    ("an advisory -> drain (never a change)", notice(severity=Severity.ADVISORY), view(), True, Drain),
    ("a host not in the group -> drain", notice(node="z"), view(), True, Drain),
    ("the only host -> drain", notice(node="a"), view(hosts=("a",)), True, Drain),
    ("fewer than min ranks would stay -> drain", notice(), view(min_world=3), True, Drain),
    ("two processes per host: min counts ranks", notice(), view(min_world=4, procs=2), True,
     ("s5-2/", ("b", "c"), "", -1, "reclaim")),
    ("a membership with other hosts -> to its hosts", membership(4, ("b", "c", "d")), view(), True,
     ("m4/", ("b", "c", "d"), "10.0.0.9:29411", 4, "membership")),
    ("a membership with the group's hosts -> settle", membership(4, ("c", "b", "a")), view(), True,
     Settle(4, "the group already has its hosts")),
    ("a membership naming no host of the group -> drain", membership(4, ("x", "y")), view(), True, Drain),
    ("a membership below min -> drain", membership(4, ("b",)), view(min_world=2), True, Drain),
    ("a membership written before its host left -> settle", membership(5, ("a", "b", "c", "d")),
     view(departed_before="d"), True, Settle(5, "it was written before d left the group")),
    ("a membership written after its host left -> to its hosts",
     membership(5, ("a", "b", "c", "d"), offered=T0 + timedelta(seconds=2)), view(departed_before="d"), True,
     ("m5/", ("a", "b", "c", "d"), "10.0.0.9:29411", 5, "membership")),
    ("a membership that does not parse -> drain", broken_membership(), view(), True, Drain),
]


@pytest.mark.parametrize("name,agreed,seen,resizable,expected", CASES, ids=[c[0] for c in CASES])
def test_decide(name, agreed, seen, resizable, expected):
    decision = decide(agreed, 5, seen, resizable)
    if expected is Drain:
        assert isinstance(decision, Drain) and decision.why
    elif isinstance(expected, Settle):
        assert decision == expected
    else:
        assert isinstance(decision, Resize), decision
        change = decision.change
        assert (change.prefix, change.plan.target_hosts, change.store, change.generation, change.reason) == expected
        assert decision.requires_durable is decision.for_notice is bool(change.plan.leaving_hosts)


def test_rank_0_finding_a_membership_current_overrides_the_stale_rule():
    """The settle vote's second look: `stale_rule=False` never settles for a departed host."""
    stale = membership(5, ("a", "b", "c", "d"))
    assert isinstance(decide(stale, 5, view(departed_before="d"), True), Settle)
    again = decide(stale, 5, view(departed_before="d"), True, stale_rule=False)
    assert isinstance(again, Resize) and again.change.plan.joining_hosts == ("d",) and not again.requires_durable
