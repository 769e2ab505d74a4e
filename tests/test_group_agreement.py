"""The hostfile the sidecar keeps for a relaunch names the hosts the group re-formed with in place.

Both come from one function (`hooks/hostfile.group_after`) under one elasticity rule (the
DeepSpeed config the sidecar reads through `--deepspeed-config` and the Guard through
`SPOTGUARD_DEEPSPEED_CONFIG`, set by the injector from the same annotation). Each case runs a real
sidecar over HTTP with a hostfile, publishes a notice or a membership, hands every `membership`
event it streams to a Guard's `MembershipView` made from the environment, decides the agreed
notice as the Guard does, and compares the group the Guard would form with the file on disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from spotguard.config import ConfigError
from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, MembershipView
from spotguard.hooks.hostfile import ElasticRule, Host, group_after, read_hostfile
from spotguard.hooks.machine.decide import Drain, Resize, Settle, decide
from spotguard.hooks.sidecar.service import Sidecar
from spotguard.wire import names
from spotguard.wire.membership import Membership
from tests.sidecar_helpers import (Publisher, StreamReader, eventually, go_quote, make_notice, sidecar_config,
                                   write_annotations)

# max_train_batch_size 32, micro sizes 4 and 8, at most 4 GPUs: world sizes 1, 2 and 4 (not 3).
ONE_TWO_FOUR = {"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [4, 8], "min_gpus": 1,
                "max_gpus": 4, "version": 0.1}
# max 24, micro size 4: world sizes 1, 2, 3 and 6 (not 4).
ONE_TWO_THREE_SIX = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [4], "max_gpus": 6}
ONLY_FOUR = {"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [8], "min_gpus": 4, "max_gpus": 4}


@dataclass(frozen=True)
class Case:
    hosts: tuple[str, ...]
    slots: int
    elasticity: dict | None
    noticed: str | None  # the sidecar's own node gets a reclaim notice
    membership: tuple[str, ...] | None  # or the supervisor pushes these hosts (with a store)
    expect: tuple[str, ...] | None  # the group both name; None: every rank drains, the file stays


CASES = {
    "a notice, no rule": Case(("w0", "w1", "w2", "w3"), 1, None, "w2", None, ("w0", "w1", "w3")),
    "a notice, 3 not allowed": Case(("w0", "w1", "w2", "w3"), 1, ONE_TWO_FOUR, "w1", None, ("w0", "w2")),
    "a notice, two slots a host": Case(("w0", "w1", "w2"), 2, ONE_TWO_THREE_SIX, "w0", None, ("w1",)),
    "a notice, nothing allowed": Case(("w0", "w1", "w2", "w3"), 1, ONLY_FOUR, "w3", None, None),
    "a grow past the rule": Case(("w0", "w1"), 1, ONE_TWO_FOUR, None, ("w0", "w1", "w2"), None),
    "a grow the rule allows": Case(("w0", "w1"), 1, ONE_TWO_FOUR, None, ("w0", "w1", "w2", "w3"),
                                   ("w0", "w1", "w2", "w3")),
    "a grow, no rule": Case(("w0", "w1"), 1, None, None, ("w1", "w0", "w5"), ("w1", "w0", "w5")),
}


def membership_line(generation: int, hosts: tuple[str, ...], world_size: int) -> str:
    value = Membership(generation, hosts, world_size, store="10.0.0.9:29411").to_wire()
    return "spotguard.io/membership=" + go_quote(json.dumps(value))


@pytest.mark.parametrize("name", list(CASES))
async def test_the_hostfile_names_the_group_the_guard_forms(tmp_path, name):
    case = CASES[name]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots={case.slots}\n" for h in case.hosts))
    before = read_hostfile(str(hostfile))
    overrides: dict = {"hostfile": str(hostfile), "podinfo_dir": str(tmp_path / "podinfo")}
    env = {names.ENV_NODE: case.hosts[1], "LOCAL_WORLD_SIZE": str(case.slots)}
    if case.elasticity is not None:
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2},
                                                      "elasticity": case.elasticity}))
        overrides["deepspeed_config"] = env[names.ENV_DEEPSPEED_CONFIG] = str(tmp_path / "ds.json")
    view = MembershipView.from_env(env)
    view.hosts = case.hosts  # the group as `learn_hosts` finds it, before the change
    if case.membership is not None:
        write_annotations(tmp_path / "podinfo", [membership_line(4, case.hosts, len(case.hosts) * case.slots)])
        view.offer(Membership(4, case.hosts, len(case.hosts) * case.slots).to_wire())  # the group's own

    async with Publisher(node=case.noticed or case.hosts[0]) as pub:
        async with Sidecar(sidecar_config(tmp_path, pub.url, **overrides)) as sidecar:
            await eventually(lambda: sidecar.live.complete, what="the agent's complete snapshot")
            async with StreamReader(sidecar.url) as stream:
                assert (await stream.next())[0] == "snapshot"
                first = await stream.next()
                assert first[0] == "membership"
                view.offer(first[1])
                if case.noticed is not None:
                    notice = make_notice(node=case.noticed)
                    await eventually(lambda: pub.connections == 1)
                    pub.add(notice)
                    assert (await stream.next())[0] == "notice"
                else:
                    write_annotations(tmp_path / "podinfo", [membership_line(5, case.membership,
                                                                             len(case.membership) * case.slots)])
                if case.expect is not None or case.membership is not None:
                    event, data = await stream.next()
                    assert event == "membership"
                    view.offer(data)
                    assert data["hostfile"] == [h.name for h in read_hostfile(str(hostfile))]  # it says the truth
                if case.membership is not None:  # the supervisor's, as every pod of the job sees it
                    assert (data["hosts"], data["store"]) == (list(case.membership), "10.0.0.9:29411")
                    notice = view.pending_notice()
                    assert notice is not None and notice.source == MEMBERSHIP_SOURCE
                decision = decide(notice, 7, view, True)
    written = read_hostfile(str(hostfile))
    if case.expect is None:
        if case.membership is not None:  # trimmed back to the group's own hosts: nothing to change
            assert isinstance(decision, Settle) and decision.generation == 5, decision
        else:
            assert isinstance(decision, Drain), decision
        assert written == before
        return
    assert isinstance(decision, Resize), decision
    plan = decision.change.plan
    assert plan.target_hosts == case.expect == tuple(h.name for h in written)
    assert plan.new_world_size == sum(h.slots for h in written)
    assert set(plan.leaving_hosts) == set(case.hosts) - set(case.expect)


def test_group_after_is_select_hosts_without_the_departing_keeping_the_hosts_listed_first():
    hosts = [Host("a", 2), Host("b", 1), Host("c", 1), Host("d", 2)]
    assert group_after(hosts, {"b"}) == [Host("a", 2), Host("c", 1), Host("d", 2)]
    assert group_after(hosts, {"a"}, cap=3) == [Host("b", 1), Host("d", 2)]
    assert group_after(hosts, set(h.name for h in hosts)) == []
    # The supervisor lists the store's host first and the members before the joiners; whatever
    # their names sort as, a trim keeps the first host and drops the joiners first.
    one_or_two = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [4], "max_gpus": 2}
    rule = ElasticRule.from_block(one_or_two)
    assert rule is not None and rule.world_sizes == (1, 2)
    members_then_joiner = [Host(n, 1) for n in ("d", "c", "a")]
    assert [h.name for h in group_after(members_then_joiner, rule=rule)] == ["d", "c"]


def test_a_trim_never_drops_the_store_host_nor_a_member_for_a_joiner(tmp_path):
    """The reviewer's cases: a group d, c offered d, c, a (a joining, d's store) under a rule of 1
    or 2 settles and a does not join; a first group n3, n1, n2 (n3's store) under 1, 2 or 4 forms
    with n3, n1, the hosts every one of them trims it to, n3 serving the store they meet at."""
    (tmp_path / "ds.json").write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 8,
                                                                 "micro_batch_sizes": [4], "max_gpus": 2}}))
    env = {names.ENV_DEEPSPEED_CONFIG: str(tmp_path / "ds.json")}
    grow = Membership(7, ("d", "c", "a"), 3, store="10.0.0.4:29400")
    survivor = MembershipView.from_env({**env, names.ENV_NODE: "c"})
    survivor.hosts = ("d", "c")
    survivor.offer(grow.to_wire())
    pending = survivor.pending_notice()
    assert pending is not None
    assert isinstance(decide(pending, 9, survivor, True), Settle)
    joiner = MembershipView.from_env({**env, names.ENV_NODE: "a"})
    assert joiner.trimmed(grow).hosts == ("d", "c")  # a is not listed: it waits
    (tmp_path / "ds.json").write_text(json.dumps({"elasticity": ONE_TWO_FOUR}))
    first = Membership(1, ("n3", "n1", "n2"), 3, store="10.0.0.3:29400", start=True)
    for node in ("n3", "n1", "n2"):
        trimmed = MembershipView.from_env({**env, names.ENV_NODE: node}).trimmed(first)
        assert (trimmed.hosts, trimmed.world_size, trimmed.store) == (("n3", "n1"), 2, "10.0.0.3:29400")


@pytest.mark.parametrize("text, field", [
    ("{oops", "is not JSON"),
    (json.dumps({"elasticity": {"enabled": True, "micro_batch_sizes": []}}), "elasticity.micro_batch_sizes"),
])
def test_a_bad_deepspeed_config_stops_the_view_naming_the_variable(tmp_path, text, field):
    config = tmp_path / "ds.json"
    config.write_text(text)
    with pytest.raises(ConfigError) as raised:
        MembershipView.from_env({names.ENV_DEEPSPEED_CONFIG: str(config)})
    assert raised.value.field == names.ENV_DEEPSPEED_CONFIG and field in str(raised.value)
    with pytest.raises(ConfigError, match="cannot read"):
        MembershipView.from_env({names.ENV_DEEPSPEED_CONFIG: str(tmp_path / "missing.json")})


def test_a_joiner_reads_its_rank_and_world_from_the_hosts_the_rule_keeps(tmp_path):
    """A joiner (and a first group, through `first`) takes its rank from the membership trimmed as
    the survivors trim it; a membership the rule trims it out of does not list it."""
    from spotguard.hooks.elastic.join import wait_for_membership

    (tmp_path / "ds.json").write_text(json.dumps({"elasticity": ONE_TWO_FOUR}))
    env = {names.ENV_NODE: "w3", "LOCAL_WORLD_SIZE": "1", names.ENV_DEEPSPEED_CONFIG: str(tmp_path / "ds.json")}
    view = MembershipView.from_env(env)
    first = Membership(1, ("w0", "w1", "w2"), 3, store="10.0.0.9:1", start=True)
    three = Membership(2, ("w0", "w1", "w3"), 3, store="10.0.0.9:1", first=first)
    four = Membership(3, ("w0", "w1", "w2", "w3"), 4, store="10.0.0.9:1")
    assert view.trimmed(three).hosts == ("w0", "w1") and view.trimmed(three).first.hosts == ("w0", "w1")
    offered = iter([three.to_wire(), four.to_wire()])
    got = wait_for_membership("w3", lambda: next(offered), timeout=5, trim=view.trimmed)
    assert (got.generation, got.hosts, got.world_size) == (3, four.hosts, 4)  # 3 of w0, w1, w3 never listed w3
    assert MembershipView("w3").trimmed(three) is three  # no rule: as written


class Gathered:
    """A group's `gather_strings` as every rank's string would come back."""

    def __init__(self, strings):
        self.strings = strings

    def gather_strings(self, value):
        return list(self.strings)


def test_ranks_that_read_different_rules_take_rank_0s(tmp_path, caplog):
    (tmp_path / "ds.json").write_text(json.dumps({"elasticity": ONE_TWO_FOUR}))
    with_rule = MembershipView.from_env({names.ENV_NODE: "a", names.ENV_DEEPSPEED_CONFIG: str(tmp_path / "ds.json")})
    rule = ",".join(map(str, (with_rule.rule.batch_size, *with_rule.rule.world_sizes)))
    without = MembershipView("b")
    with caplog.at_level("ERROR", logger="spotguard.hooks.elastic"):
        assert without.learn_hosts(Gathered([f"a\t{rule}", "b\t"])) == ("a", "b")
    assert without.rule == with_rule.rule and "different elasticity rules" in caplog.text
    assert with_rule.learn_hosts(Gathered(["b\t", f"a\t{rule}"])) == ("b", "a") and with_rule.rule is None
    agreeing = MembershipView("c")
    assert agreeing.learn_hosts(Gathered(["c\t", "d\t"])) == ("c", "d") and agreeing.rule is None
