"""The supervisor's side of the replacement hold (supervisor/in_place.py `held_for_replacement`),
pure: a member on a noticed node stays listed while a replacement is on its way, one per
replacement, and the membership that admits the replacement leaves it out (one change, the
world size kept); the membership says `standby` for a backfill job with a spare."""
from __future__ import annotations

from spotguard.supervisor import membership
from spotguard.supervisor.in_place import held_for_replacement, in_place_members
from spotguard.wire.membership import Membership
from tests.test_supervisor_in_place import pod

PREVIOUS = ("n0", "n1", "n2")


def nodes_with_notice(*noticed: str):
    return (lambda p: p["spec"]["nodeName"] not in noticed), (lambda p: p["spec"]["nodeName"] in noticed)


def hosts(pods, admit: bool = True, noticed: tuple[str, ...] = ("n1",)) -> tuple[str, ...]:
    healthy, on_notice = nodes_with_notice(*noticed)
    member = held_for_replacement(pods, PREVIOUS, "node", healthy, on_notice, admit)
    return in_place_members(pods, PREVIOUS, "node", member, admit)[0]


def test_a_noticed_member_stays_while_its_replacement_starts_and_is_swapped_when_it_is_ready():
    members = [pod(0, "n0"), pod(1, "n1"), pod(2, "n2")]
    assert hosts(members) == ("n0", "n2")  # no replacement on its way: it leaves at once, as before
    spare = pod(3, "", phase="Pending")
    spare["spec"]["schedulingGates"] = [{"name": "spotguard.io/capacity"}]
    assert hosts([*members, spare]) == PREVIOUS  # the gated spare: the warm standby places it now
    starting = [*members, pod(3, "n3")]  # the spare, placed, not Ready yet
    assert hosts(starting) == PREVIOUS
    ready = [*members, pod(3, "n3", ready=True)]
    assert hosts(ready) == ("n0", "n2", "n3")  # one membership: n1 out, n3 in
    assert hosts(ready, admit=False) == PREVIOUS  # the settle window holds the joiner back: n1 stays too


def test_one_member_is_held_per_replacement_and_a_rank_that_left_drops_out():
    members = [pod(0, "n0"), pod(1, "n1"), pod(2, "n2"), pod(3, "n3")]
    assert hosts(members, noticed=("n1", "n2")) == ("n0", "n1")  # one replacement: the first listed is held
    left = [pod(0, "n0"), pod(1, "n1", phase="Failed"), pod(2, "n2"), pod(3, "n3")]
    assert hosts(left) == ("n0", "n2")  # its rank left at its safe moment (exit 83): not Running


def test_the_membership_of_a_job_with_a_spare_says_standby():
    text = membership.membership_json(4, ("n0", "n2"), 2, store="10.0.0.1:29411", standby=True)
    assert Membership.from_json(text).standby
    assert not Membership.from_json(membership.membership_json(4, ("n0",), 1, store="10.0.0.1:29411")).standby
