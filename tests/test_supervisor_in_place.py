"""Pure parts of the in-place membership (supervisor/in_place.py) and its policy: the stable host
order, who is a member (survivors stay, joiners only once Ready), the store of the first host,
and the decision on a notice (no scaling, the notice recorded). The cluster side runs against a
real kube-apiserver in tests/test_k8s_in_place.py."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, UTC

import pytest

from spotguard.supervisor.in_place import (fresh_members, group_gone, in_place_members, incarnation, joiners_settled,
                                           member_pods, ready_joiners, stable_hosts, start_members, starting_joiners,
                                           store_of)
from spotguard.supervisor.membership_plan import JobPods
from spotguard.supervisor.policy import (RECORD, SCALE, SUSPEND, JobState, NoticeHit, Policy, PolicyError, Settings,
                                         decide, parse_policy)
from spotguard.supervisor.record import Record, parse_record
from spotguard.wire import names

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
IN_PLACE = Policy("elastic", 2, 4, None, in_place=True)
HIT = (NoticeHit("aws.spot:1", "n0", "reclaim", T0 + timedelta(seconds=120)),)


def pod(index: int, node: str, *, ready: bool = False, phase: str = "Running", ip: str = "",
        port: str | None = None) -> dict:
    env = [{"name": names.ENV_RDZV_PORT, "value": port}] if port is not None else []
    return {"metadata": {"name": f"train-{index}", "annotations": {"batch.kubernetes.io/job-completion-index":
                                                                   str(index)}},
            "spec": {"nodeName": node, "containers": [{"name": "trainer", "env": env}]},
            "status": {"phase": phase, "podIP": ip or f"10.0.0.{index + 1}",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def healthy_except(*noticed: str):
    return lambda p: p["spec"]["nodeName"] not in noticed


@pytest.mark.parametrize("previous,current,expected", [
    ((), ("a", "b", "c"), ("a", "b", "c")),  # the first push: completion-index order
    (("c", "a", "b"), ("a", "b", "c"), ("c", "a", "b")),  # survivors keep their order
    (("c", "a", "b"), ("a", "b"), ("a", "b")),  # a leaver drops out, rank 0 moves to the next survivor
    (("c", "a"), ("a", "b", "c", "d"), ("c", "a", "b", "d")),  # joiners appended, never reordered before
    (("a", "b"), ("b", "b", "a"), ("a", "b")),  # repeats dropped
])
def test_stable_hosts_keep_the_survivors_order_and_append_joiners(previous, current, expected):
    assert stable_hosts(previous, current) == expected


def test_a_joiner_is_a_member_only_once_ready_and_a_survivor_without_readiness_stays():
    pods = [pod(0, "n0"), pod(1, "n1"), pod(2, "n2"), pod(3, "n3")]
    # The first push lists the launcher's group: readiness is not asked of it.
    assert [p["spec"]["nodeName"] for p in member_pods(pods, (), "node", healthy_except("n0"))] == ["n1", "n2", "n3"]
    # n0 left (notice); its replacement for index 0 runs on n4 but is not Ready: not a member yet.
    survivors = ("n2", "n1", "n3")
    pods[0] = pod(0, "n4")
    hosts, store = in_place_members(pods, survivors, "node", healthy_except())
    assert hosts == survivors and store == "10.0.0.3:29411"  # n2 (index 2) is rank 0: its pod's store
    # Once Ready it is appended, although its completion index is the lowest.
    pods[0] = pod(0, "n4", ready=True)
    hosts, _ = in_place_members(pods, survivors, "node", healthy_except())
    assert hosts == ("n2", "n1", "n3", "n4")
    # A pod that is not Running, or on a noticed node, is never a member, Ready or not.
    pods[1] = pod(1, "n1", ready=True, phase="Failed")
    hosts, store = in_place_members(pods, survivors, "node", healthy_except("n2"))
    assert hosts == ("n3", "n4") and store == "10.0.0.4:29411"


def test_the_store_takes_the_trainer_port_and_brackets_ipv6():
    assert store_of(pod(0, "n0", ip="10.1.2.3", port="31000")) == "10.1.2.3:31000"
    assert store_of(pod(0, "n0", ip="fd00::5")) == f"[fd00::5]:{names.RDZV_PORT}"
    assert store_of(pod(0, "n0", ip="10.1.2.3", port="bogus")) == f"10.1.2.3:{names.RDZV_PORT}"
    no_ip = pod(0, "n0")
    no_ip["status"]["podIP"] = None
    assert store_of(no_ip) == ""


def test_parse_in_place_policy():
    annotations = {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2", names.ANN_IN_PLACE: "true"}
    assert parse_policy(annotations, 4) == IN_PLACE
    assert not parse_policy({**annotations, names.ANN_IN_PLACE: "false"}, 4).in_place
    for bad in ({names.ANN_IN_PLACE: "true"}, {**annotations, names.ANN_IN_PLACE: "yes"}):
        with pytest.raises(PolicyError) as err:
            parse_policy(bad, 4)  # fixed + in-place, or a value other than true/false
        assert err.value.field == names.ANN_IN_PLACE


def test_an_in_place_notice_records_itself_and_scales_nothing():
    st = JobState(IN_PLACE, 4, False, Record(), HIT, healthy_replicas=3)
    decision = decide(st, T0)
    assert decision.action == RECORD and decision.replicas is None
    assert decision.reason == names.EVENT_LEAVING_IN_PLACE and decision.record.handled == ("aws.spot:1",)
    assert decision.record.phase == "Running" and decision.record.reclaims_survived == 1
    handled = decide(JobState(IN_PLACE, 4, False, decision.record, HIT, healthy_replicas=3), T0)
    assert not handled.acts
    below_min = decide(JobState(IN_PLACE, 4, False, Record(), HIT, healthy_replicas=1), T0)
    assert below_min.action == SUSPEND  # as elastic: too few survivors to go on


def test_the_record_keeps_the_store():
    record = Record(generation=3, members=("n1", "n2"), store="10.0.0.2:29411", member_pods=("u1/0", "u2/1"))
    assert parse_record(record.to_json()) == record


def incarnated(index: int, node: str, *, uid: str = "", restarts: int = 0, state: str = "running", **kw) -> dict:
    p = pod(index, node, **kw)
    p["metadata"]["uid"] = uid or f"uid-{index}"
    p["status"]["containerStatuses"] = [{"name": "trainer", "restartCount": restarts, "state": {state: {}}}]
    return p


def test_the_group_is_gone_only_when_no_member_pod_runs_as_it_was_pushed():
    members = [incarnated(i, f"n{i}") for i in range(3)]
    pushed = tuple(incarnation(p) for p in members)
    assert pushed == ("uid-0/0", "uid-1/0", "uid-2/0")
    assert not group_gone(members, pushed)
    assert not group_gone(members, ())  # a record from before member_pods: cannot tell, never gone
    # One member still runs as pushed: the group lives (the others are replacements or restarts).
    mixed = [incarnated(0, "n0", uid="new-0"), incarnated(1, "n1", restarts=1), members[2]]
    assert not group_gone(mixed, pushed)
    # restartPolicy Never after a fallback: new pods (new uids), even on the same nodes.
    assert group_gone([incarnated(i, f"n{i}", uid=f"new-{i}") for i in range(3)], pushed)
    # OnFailure: the same pods, every container restarted (or stopped, waiting to restart).
    assert group_gone([incarnated(0, "n0", restarts=1), incarnated(1, "n1", state="waiting"),
                       incarnated(2, "n2", state="terminated")], pushed)
    assert group_gone([], pushed)


def test_the_relaunched_group_is_pushed_whole_in_completion_index_order_with_index_0s_store():
    relaunched = [incarnated(2, "n7", uid="c"), incarnated(0, "n5", uid="a"), incarnated(1, "n6", uid="b")]
    hosts, store, pods = fresh_members(relaunched, 3, "node")
    assert hosts == ("n5", "n6", "n7") and store == "10.0.0.1:29411" and pods == ("a/0", "b/0", "c/0")
    assert fresh_members(relaunched[:2], 3, "node") is None  # one is not re-created yet
    pending = [*relaunched[:2], incarnated(1, "n6", uid="b", phase="Pending")]
    assert fresh_members(pending, 3, "node") is None


def test_ready_joiners_wait_for_replacements_still_starting_for_at_most_the_settle_window():
    survivors = ("n1", "n2")
    pods = [pod(1, "n1"), pod(2, "n2"), pod(0, "n5", ready=True), pod(3, "n6")]
    assert [p["spec"]["nodeName"] for p in ready_joiners(pods, survivors, "node", healthy_except())] == ["n5"]
    assert [p["spec"]["nodeName"] for p in starting_joiners(pods, survivors, "node", healthy_except())] == ["n6"]
    assert starting_joiners(pods, survivors, "node", healthy_except("n6")) == []  # a noticed node starts nothing
    assert not joiners_settled([1.0], 1, 10.0) and joiners_settled([10.0], 1, 10.0) and joiners_settled([1.0], 0, 10.0)
    held = in_place_members(pods, survivors, "node", healthy_except(), admit_joiners=False)
    assert held[0] == survivors
    pods[3] = pod(3, "n6", ready=True)  # both Ready: both in one membership
    assert in_place_members(pods, survivors, "node", healthy_except())[0] == ("n1", "n2", "n5", "n6")


def test_start_at_min_waits_for_min_ready_pods_then_lists_exactly_those():
    """The first group of a start-at-min job: Ready pods in completion-index order, once min are."""
    pods = [pod(0, "n0"), pod(1, "n1", ready=True), pod(2, "n2"), pod(3, "n3", ready=True, phase="Pending")]
    assert start_members(pods, 2, "node", healthy_except()) is None  # one Ready, Running pod
    pods[2] = pod(2, "n2", ready=True)
    hosts, store, incarnations = start_members(pods, 2, "node", healthy_except())
    assert (hosts, store, len(incarnations)) == (("n1", "n2"), "10.0.0.2:29411", 2)
    assert start_members(pods, 2, "node", healthy_except("n1")) is None  # a noticed node does not count
    with pytest.raises(PolicyError) as err:
        parse_policy({names.ANN_POLICY: "elastic", names.ANN_START_AT_MIN: "true"}, 4)
    assert err.value.field == names.ANN_START_AT_MIN  # start at min needs in place
    assert parse_policy({names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true",
                         names.ANN_START_AT_MIN: "true"}, 4).start_at_min
    assert parse_record(Record(generation=3, start_generation=3).to_json()).start_generation == 3


@pytest.mark.parametrize("hosts,previous,limit,replaceable,expected", [
    (("a", "b", "c"), ("a", "b", "c"), None, (), ("a", "b", "c")),  # no limit
    (("a", "b", "s"), ("a", "b"), 2, ("b",), ("a", "s")),  # the swap: s takes b's place, one membership
    (("a", "b", "s"), ("a", "b"), 2, ("a", "b"), ("a", "s")),  # the last listed on-demand host goes: rank 0 stays
    (("a", "b", "s"), ("a", "b"), 2, (), ("a", "b")),  # nothing to replace: the joiner waits
    (("a", "b", "s", "t"), ("a", "b"), 3, ("a", "b"), ("a", "s", "t")),  # two joiners, one place over the limit
    (("a", "b", "s"), ("a", "b", "c"), 3, ("b",), ("a", "b", "s")),  # c left: s fills its place, nobody goes
    (("a", "b", "o"), ("a", "b"), 2, ("b", "o"), ("a", "b")),  # an on-demand joiner displaces no one: it waits
    (("a", "b", "o", "s"), ("a", "b"), 3, ("b", "o"), ("a", "b", "s")),  # the on-demand joiner waits first
])
def test_a_membership_never_lists_more_than_max_hosts(hosts, previous, limit, replaceable, expected):
    from spotguard.supervisor.in_place import capped

    assert capped(hosts, previous, limit, replaceable) == expected


def test_a_gated_spare_is_not_a_replacement_on_its_way():
    spare = pod(4, "")
    spare["spec"]["schedulingGates"] = [{"name": "spotguard.io/capacity"}]
    spare["status"] = {"phase": "Pending"}
    assert starting_joiners([pod(0, "n0"), spare], ("n0",), "node", healthy_except()) == []
    del spare["spec"]["schedulingGates"]  # placed: on its way now
    assert starting_joiners([pod(0, "n0"), spare], ("n0",), "node", healthy_except()) == [spare]


# ---- the membership comes with the decision (membership_plan.py, through policy.decide) ----------
def uid_pod(index: int, node: str, **kw) -> dict:
    p = pod(index, node, **kw)
    p["metadata"]["uid"] = f"uid-{index}"
    return p


def job_pods(pods: list[dict], departing: tuple[str, ...] = (), **kw) -> JobPods:
    nodes = frozenset(p["spec"]["nodeName"] for p in pods) | frozenset(departing)
    return JobPods(replicas=tuple(pods), every=tuple(pods), nodes=nodes, departing=frozenset(departing), **kw)


def told(decision) -> dict:
    return json.loads(decision.membership.value)


def test_decide_returns_the_membership_the_notice_makes_with_the_record_that_names_it():
    pods = [uid_pod(i, f"n{i}") for i in range(4)]
    st = JobState(IN_PLACE, 4, False, Record(), HIT, healthy_replicas=3, pods=job_pods(pods, departing=("n0",)))
    decision = decide(st, T0)
    assert decision.action == RECORD and decision.reason == names.EVENT_LEAVING_IN_PLACE
    rec = decision.record
    assert (rec.generation, rec.members, rec.store) == (1, ("n1", "n2", "n3"), "10.0.0.2:29411")
    assert rec.member_pods == ("uid-1/0", "uid-2/0", "uid-3/0")
    assert told(decision)["hosts"] == ["n1", "n2", "n3"] and told(decision)["generation"] == 1
    assert decision.membership.pods == ("train-0", "train-1", "train-2", "train-3")  # the leaver is told too
    assert decision.membership.why == "members changed"
    # The pods told, the same state decides nothing new: no second write, nothing to push.
    for p in pods:
        p["metadata"]["annotations"][names.ANN_MEMBERSHIP] = decision.membership.value
    again = decide(JobState(IN_PLACE, 4, False, rec, HIT, healthy_replicas=3, pods=job_pods(pods, ("n0",))), T0)
    assert not again.acts and again.record == rec and again.membership.pods == ()


def test_an_elastic_scale_carries_its_membership():
    pods = [uid_pod(i, f"n{i}") for i in range(4)]
    elastic = Policy("elastic", 2, 4, None)
    decision = decide(JobState(elastic, 4, False, Record(), HIT, healthy_replicas=3,
                               pods=job_pods(pods, ("n0",), per_replica=2)), T0)
    assert decision.action == SCALE and decision.replicas == 3
    assert decision.record.generation == 1 and decision.record.members == ("n1", "n2", "n3")
    assert told(decision)["world_size"] == 6 and not told(decision).get("store")


@pytest.mark.parametrize("policy", [IN_PLACE, Policy("elastic", 2, 4, None)], ids=["in-place", "elastic"])
def test_a_node_that_is_not_departing_keeps_its_member(policy):
    """A rebalance or a maintenance beyond the horizon is no departure (notice_policy): the
    membership keeps its host, so nothing is pushed and no generation is added."""
    pods = [uid_pod(i, f"n{i}") for i in range(4)]
    for p in pods:
        p["metadata"]["annotations"][names.ANN_MEMBERSHIP] = ""
    rec = Record(decided_at=T0, generation=3, members=("n0", "n1", "n2", "n3"),
                 store="10.0.0.1:29411" if policy.in_place else "", member_pods=tuple(incarnation(p) for p in pods))
    decision = decide(JobState(policy, 4, False, rec, (), healthy_replicas=4, pods=job_pods(pods),
                               release_at=T0 + timedelta(seconds=480)), T0)
    assert not decision.acts and decision.record == rec and told(decision)["hosts"] == list(rec.members)
    assert decision.recheck_at == T0 + timedelta(seconds=480)


SETTLE = Settings(join_settle=10.0)
SURVIVORS = Record(decided_at=T0, generation=2, members=("n1", "n2"), store="10.0.0.2:29411",
                   member_pods=("uid-1/0", "uid-2/0"))


def settling(record: Record, offset: float, *, second_ready: bool = False):
    """Survivors on n1, n2; a Ready joiner on n5 and another replacement on n6, Ready or not."""
    pods = [uid_pod(1, "n1"), uid_pod(2, "n2"), uid_pod(0, "n5", ready=True), uid_pod(3, "n6", ready=second_ready)]
    st = JobState(IN_PLACE, 4, False, record, (), healthy_replicas=4, pods=job_pods(pods))
    return decide(st, T0 + timedelta(seconds=offset), SETTLE)


def test_the_join_settle_clock_lives_in_the_record():
    held = settling(SURVIVORS, 0)
    assert held.record.members == SURVIVORS.members and held.record.ready_seen == {"uid-0": T0}
    assert held.recheck_at == T0 + timedelta(seconds=10) and held.membership.why == ""
    # A restarted supervisor reads the record back: the same window, the same moment to admit.
    stored = parse_record(held.record.to_json())
    assert stored == held.record
    later = settling(stored, 5)
    assert later.record == stored and later.recheck_at == T0 + timedelta(seconds=10)  # nothing to write
    due = settling(stored, 10)
    assert due.record.members == ("n1", "n2", "n5") and due.record.generation == 3 and due.record.ready_seen is None
    both = settling(stored, 5, second_ready=True)  # the other one Ready in time: both in one membership
    assert both.record.members == ("n1", "n2", "n5", "n6") and both.record.generation == 3


def test_a_return_to_spot_carries_its_drain_on_the_membership():
    pods = [uid_pod(i, f"n{i}") for i in range(2)]
    rec = Record(phase="Checkpointing", decided_at=T0, generation=4, members=("n0", "n1"), store="10.0.0.1:29411",
                 drain="d1", move_to="spot", checkpoint_deadline=T0 + timedelta(seconds=60))
    decision = decide(JobState(IN_PLACE, 2, False, rec, (), healthy_replicas=2, pods=job_pods(pods)), T0)
    assert decision.record == rec and told(decision)["drain"] == "d1" and told(decision)["generation"] == 4


def test_steps_lost_are_counted_in_the_same_record():
    drained = uid_pod(0, "n0", phase="Failed")
    drained["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
        "exitCode": 83, "finishedAt": "2026-01-02T03:04:06Z", "message": '{"v":1,"steps_lost":7}'}}}]
    pods = [uid_pod(1, "n1"), uid_pod(2, "n2")]
    st = JobState(IN_PLACE, 3, False, Record(), HIT, healthy_replicas=2,
                  pods=JobPods(replicas=tuple(pods), every=(drained, *pods), nodes=frozenset({"n0", "n1", "n2"}),
                               departing=frozenset({"n0"})))
    decision = decide(st, T0)
    assert decision.record.steps_lost == 7 and decision.record.generation == 1 and decision.record.handled


@pytest.mark.parametrize("policy", [IN_PLACE, Policy("elastic", 2, 4, None)], ids=["in-place", "elastic"])
def test_a_finished_training_gets_no_new_membership(policy):
    """A rank exits 0 only when the training is done: the ranks still finishing are not told to
    re-form without it, and a replacement scheduled onto its freed node is not admitted."""
    survivors = [uid_pod(0, "n0"), uid_pod(1, "n1")]
    rec = Record(decided_at=T0, generation=1, members=("n0", "n1"), store="10.0.0.1:29411" if policy.in_place else "",
                 member_pods=tuple(incarnation(p) for p in survivors))
    done = uid_pod(0, "n0", phase="Succeeded")
    joiner = uid_pod(2, "n0", ready=True)
    running = (survivors[1], joiner)
    pods = JobPods(replicas=running, every=(done, *running), nodes=frozenset({"n0", "n1"}))
    decision = decide(JobState(policy, 3, False, rec, (), healthy_replicas=2, pods=pods), T0 + timedelta(seconds=60),
                      SETTLE)
    assert not decision.acts and decision.record == rec and decision.membership is None
    # The same pods before any of them finished: the membership follows them (what the rule stops).
    before = JobPods(replicas=running, every=running, nodes=frozenset({"n0", "n1"}))
    moved = decide(JobState(policy, 3, False, rec, (), healthy_replicas=2, pods=before), T0 + timedelta(seconds=60),
                   SETTLE)
    assert moved.record.generation == 2 and moved.membership is not None


def test_an_admission_right_after_the_start_names_the_start_as_its_first():
    """Start at min: a pod Ready 30 ms after the `start` push is admitted at once, and its
    membership names the start (`first`): a sidecar relays only the newest membership, so a host
    of the start may read only the admission and must still form the first group (before: a CI
    run pushed both 27 ms apart and the hosts formed two different groups)."""
    policy = parse_policy({names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true", names.ANN_START_AT_MIN: "true",
                           names.ANN_MIN_REPLICAS: "2", names.ANN_MAX_REPLICAS: "3"}, 3)
    pods = [uid_pod(0, "n0", ready=True), uid_pod(1, "n1", ready=True), uid_pod(2, "n2")]

    def decided(record: Record, offset: float):
        st = JobState(policy, 3, False, record, (), healthy_replicas=3, pods=job_pods(pods))
        return decide(st, T0 + timedelta(seconds=offset), SETTLE)

    start = decided(Record(), 0)
    assert start.record.members == ("n0", "n1") and told(start)["start"] and "first" not in told(start)
    pods[2] = uid_pod(2, "n2", ready=True)
    stored = parse_record(start.record.to_json())
    assert stored == start.record
    admitted = decided(stored, 0.03)
    assert admitted.record.members == ("n0", "n1", "n2")
    assert admitted.record.generation == start.record.generation + 1 and "start" not in told(admitted)
    assert told(admitted)["first"] == {**told(start), "v": 1}
    assert parse_record(admitted.record.to_json()) == admitted.record


def test_a_host_of_the_start_back_with_a_new_pod_is_told_no_first_group():
    """Start at min with n0 alone; n1 admitted (its membership names the start as `first`). Then
    n0's pod goes (its node reclaimed) and the node comes back with a new pod: the memberships
    from then on name no `first`, so the new pod on n0 joins the live group instead of forming
    the start's group again from the checkpoint (a CI run: the returned spot node read the swap's
    membership, found the start listing its host and no group at the start's store, and formed a
    second group)."""
    policy = parse_policy({names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true", names.ANN_START_AT_MIN: "true",
                           names.ANN_MIN_REPLICAS: "1", names.ANN_MAX_REPLICAS: "2"}, 2)
    pods = [uid_pod(0, "n0", ready=True), uid_pod(1, "n1")]
    record, offset = Record(), 0.0

    def decided() -> dict | None:
        nonlocal record, offset
        st = JobState(policy, 2, False, record, (), healthy_replicas=len(pods), pods=job_pods(pods))
        offset += SETTLE.join_settle + 1
        decision = decide(st, T0 + timedelta(seconds=offset), SETTLE)
        record = parse_record(decision.record.to_json())
        return told(decision) if decision.membership is not None else None

    start = decided()
    assert start is not None and start["hosts"] == ["n0"] and start["start"]
    pods[1] = uid_pod(1, "n1", ready=True)
    admitted = decided()
    assert admitted is not None and admitted["hosts"] == ["n0", "n1"] and admitted["first"]["hosts"] == ["n0"]
    del pods[0]
    left = decided()
    assert left is not None and left["hosts"] == ["n1"] and "first" not in left, left
    back = uid_pod(0, "n0", ready=True)
    back["metadata"]["uid"] = "uid-0-new-instance"
    pods.insert(0, back)
    readmitted = decided()
    assert readmitted is not None and readmitted["hosts"] == ["n1", "n0"] and "first" not in readmitted, readmitted
