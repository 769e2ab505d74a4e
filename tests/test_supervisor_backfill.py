"""supervisor.backfill.plan: spot first, warm standby, on-demand after fallback-after (capped by
on-demand-max), and one swap-back at a time after return-after, never below the job's size."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spotguard.supervisor.backfill import BackfillClocks, BackfillSettings, BackfillView, plan

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SETTINGS = BackfillSettings(max_replicas=4, fallback_after=120.0, return_after=300.0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_spot_slots_fill_the_gap_first_and_at_once():
    step = plan(SETTINGS, BackfillView(spot=2, on_demand=0, spot_free=1, on_demand_free=8), BackfillClocks(), T0)
    assert (step.add_spot, step.add_on_demand, step.swap) == (1, 0, False)
    assert step.clocks.below_max_since == T0 and step.recheck_at == at(120)  # the last gap waits for fallback-after


def test_on_demand_only_after_fallback_after_below_max():
    view = BackfillView(spot=3, on_demand=0, on_demand_free=8)
    first = plan(SETTINGS, view, BackfillClocks(), T0)
    assert not first.acts and first.recheck_at == at(120)
    early = plan(SETTINGS, view, first.clocks, at(119))
    assert not early.acts
    due = plan(SETTINGS, view, first.clocks, at(120))
    assert due.add_on_demand == 1 and "fallback-after 120s" in due.reason
    # asked for, not a member yet: not asked again
    again = plan(SETTINGS, BackfillView(spot=3, on_demand=0, starting_on_demand=1, on_demand_free=7), due.clocks,
                 at(121))
    assert not again.acts


def test_a_job_back_at_max_resets_the_below_max_clock():
    clocks = plan(SETTINGS, BackfillView(spot=3, on_demand=0), BackfillClocks(), T0).clocks
    full = plan(SETTINGS, BackfillView(spot=4, on_demand=0), clocks, at(60))
    assert full.clocks.below_max_since is None
    assert plan(SETTINGS, BackfillView(spot=3, on_demand=0, on_demand_free=1), full.clocks, at(130)).add_on_demand == 0


def test_warm_standby_asks_for_the_replacement_at_the_notice():
    noticed = BackfillView(spot=3, on_demand=0, leaving=1, on_demand_free=4)
    step = plan(SETTINGS, noticed, BackfillClocks(), T0)
    assert step.add_on_demand == 1 and "warm standby" in step.reason and "no spot slot free" in step.reason
    settled = BackfillClocks(spot_free_since=at(-300))  # spot free for return-after already
    with_spot = BackfillView(spot=3, on_demand=0, leaving=1, spot_free=1, on_demand_free=4)
    trusted = plan(SETTINGS, with_spot, settled, T0)
    assert (trusted.add_spot, trusted.add_on_demand) == (1, 0)


def test_a_standby_goes_to_on_demand_while_spot_has_not_stayed_free_for_return_after():
    """Spot that has just come back is the likeliest to be reclaimed again, during the standby's
    start-up: the standby, which must be Ready before the deadline, takes on-demand."""
    fresh = BackfillView(spot=3, on_demand=0, leaving=1, spot_free=1, on_demand_free=4)
    step = plan(SETTINGS, fresh, BackfillClocks(spot_free_since=at(-299)), T0)
    assert (step.add_spot, step.add_on_demand) == (0, 1) and "less than return-after 300s" in step.reason
    no_room = BackfillView(spot=3, on_demand=0, leaving=1, spot_free=1, on_demand_free=0)
    only_spot = plan(SETTINGS, no_room, BackfillClocks(), T0)
    assert (only_spot.add_spot, only_spot.add_on_demand) == (1, 0)
    # a job also below max by one more: only the standby is at once, the other gap waits for spot
    # first, then for fallback-after
    short = BackfillView(spot=2, on_demand=0, leaving=1, spot_free=1, on_demand_free=4)
    both = plan(SETTINGS, short, BackfillClocks(), T0)
    assert (both.add_spot, both.add_on_demand) == (1, 1)
    alone = plan(SETTINGS, BackfillView(spot=2, on_demand=0, leaving=1, on_demand_free=4), BackfillClocks(), T0)
    assert (alone.add_spot, alone.add_on_demand, alone.recheck_at) == (0, 1, at(120))


def test_on_demand_max_caps_the_backfill():
    capped = BackfillSettings(max_replicas=4, fallback_after=1.0, return_after=1.0, on_demand_max=1)
    view = BackfillView(spot=1, on_demand=0, on_demand_free=8)
    clocks = plan(capped, view, BackfillClocks(), T0).clocks
    assert plan(capped, view, clocks, at(2)).add_on_demand == 1
    assert not plan(capped, BackfillView(spot=1, on_demand=1, on_demand_free=8), clocks, at(3)).acts


def test_swap_back_one_at_a_time_after_return_after():
    at_max = BackfillView(spot=2, on_demand=2, spot_free=3)
    first = plan(SETTINGS, at_max, BackfillClocks(), T0)
    assert not first.acts and first.clocks.spot_free_since == T0 and first.recheck_at == at(300)
    swap = plan(SETTINGS, at_max, first.clocks, at(300))
    assert swap.swap and (swap.add_spot, swap.add_on_demand) == (0, 0)
    during = plan(SETTINGS, BackfillView(spot=2, on_demand=2, starting_spot=1, spot_free=2), swap.clocks, at(301))
    assert not during.acts  # the next swap waits for this one
    after = plan(SETTINGS, BackfillView(spot=3, on_demand=1, spot_free=2), swap.clocks, at(310))
    assert after.swap


def test_no_swap_while_spot_is_busy_or_a_member_leaves():
    clocks = plan(SETTINGS, BackfillView(spot=2, on_demand=2, spot_free=1), BackfillClocks(), T0).clocks
    busy = plan(SETTINGS, BackfillView(spot=2, on_demand=2, spot_free=0), clocks, at(200))
    assert busy.clocks.spot_free_since is None
    assert not plan(SETTINGS, BackfillView(spot=2, on_demand=2, spot_free=1), busy.clocks, at(400)).swap
    leaving = plan(SETTINGS, BackfillView(spot=1, on_demand=2, leaving=1, spot_free=1, starting_spot=1), clocks,
                   at(400))
    assert not leaving.swap


def test_conflicting_backfill_annotations_name_the_annotation():
    from spotguard.supervisor.policy import PolicyError, check_template, parse_policy
    from spotguard.supervisor.record import Record
    from spotguard.wire import names

    base = {names.ANN_POLICY: "elastic", names.ANN_FALLBACK: "on-demand"}
    assert parse_policy({**base, names.ANN_ON_DEMAND_MAX: "2"}, default_max=4).on_demand_max == 2
    for given, field, words in (
            ({**base, names.ANN_ON_DEMAND_MAX: "5"}, names.ANN_ON_DEMAND_MAX, "above"),
            ({names.ANN_POLICY: "elastic", names.ANN_ON_DEMAND_MAX: "1"}, names.ANN_ON_DEMAND_MAX, "needs"),
            ({names.ANN_POLICY: "fixed", names.ANN_IN_PLACE: "true"}, names.ANN_IN_PLACE, "needs")):
        try:
            parse_policy(given, default_max=4)
        except PolicyError as exc:
            assert exc.field == field and words in exc.message
        else:
            raise AssertionError(f"{given} passed")
    policy = parse_policy(base, default_max=4)
    spot = {"worker": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"}}}
    either = {"worker": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "eks.amazonaws.com/capacityType", "operator": "In",
                                                     "values": ["SPOT", "ON_DEMAND"]}]}]}}}}}
    check_template(policy, spot, Record())
    check_template(policy, either, Record())
    check_template(policy, {"worker": {"nodeSelector": {"pool": "a"}}}, Record(capacity="on-demand"))  # moved already
    try:
        check_template(policy, {"worker": {"nodeSelector": {"pool": "a"}}}, Record())
    except PolicyError as exc:
        assert exc.field == names.ANN_FALLBACK and "capacity-type label" in exc.message
    else:
        raise AssertionError("a template with no capacity-type label passed")


def test_placement_places_gated_pods_lowest_index_first_and_counts_placed_ones_as_starting():
    from spotguard.supervisor import capacity_type
    from spotguard.supervisor.placement import ON_DEMAND, SPOT, PodFacts, place, placement_patch

    pods = [PodFacts("p3", 3), PodFacts("p1", 1), PodFacts("p0", 0, SPOT, member=True), PodFacts("p2", 2)]
    first = place(SETTINGS, pods, spot_free=1, on_demand_free=4, clocks=BackfillClocks(), now=T0)
    assert first.pods == (("p1", SPOT),) and first.split == {SPOT: 2, ON_DEMAND: 0}
    placed = [PodFacts("p3", 3), PodFacts("p1", 1, SPOT), PodFacts("p0", 0, SPOT, member=True), PodFacts("p2", 2)]
    # p1 is placed, not yet running: the spot slot it takes still looks free, it is not used twice
    early = place(SETTINGS, placed, spot_free=1, on_demand_free=4, clocks=first.step.clocks, now=at(1))
    assert early.pods == ()
    due = place(SETTINGS, placed, spot_free=1, on_demand_free=4, clocks=first.step.clocks, now=at(120))
    assert due.pods == (("p2", ON_DEMAND), ("p3", ON_DEMAND)) and due.split == {SPOT: 2, ON_DEMAND: 2}
    label = capacity_type.BY_KEY["karpenter.sh/capacity-type"]
    assert placement_patch(label, ON_DEMAND, [{"name": "spotguard.io/capacity"}]) == {
        "spec": {"nodeSelector": {label.key: "on-demand"}, "schedulingGates": None}}
    other = {"name": "example.com/quota"}
    assert placement_patch(label, SPOT, [other, {"name": "spotguard.io/capacity"}])["spec"] == {
        "nodeSelector": {label.key: "spot"}, "schedulingGates": [other]}


def test_the_spare_stays_gated_while_the_job_is_whole_and_is_placed_at_a_notice_or_for_a_swap():
    from spotguard.supervisor.placement import ON_DEMAND, SPOT, PodFacts, place

    whole = [PodFacts("p0", 0, SPOT, member=True), PodFacts("p1", 1, ON_DEMAND, member=True),
             PodFacts("p2", 2, SPOT, member=True), PodFacts("p3", 3, SPOT, member=True), PodFacts("p4", 4)]
    assert place(SETTINGS, whole, spot_free=0, on_demand_free=4, clocks=BackfillClocks(), now=T0).pods == ()
    # a notice on p0's node: the spare is the warm standby, on spot where spot has been free for
    # return-after, else on-demand
    noticed = [PodFacts("p0", 0, SPOT, leaving=True), *whole[1:]]
    assert place(SETTINGS, noticed, spot_free=0, on_demand_free=4, clocks=BackfillClocks(),
                 now=T0).pods == (("p4", ON_DEMAND),)
    assert place(SETTINGS, noticed, spot_free=1, on_demand_free=4, clocks=BackfillClocks(),
                 now=T0).pods == (("p4", ON_DEMAND),)
    assert place(SETTINGS, noticed, spot_free=1, on_demand_free=4, clocks=BackfillClocks(spot_free_since=at(-300)),
                 now=T0).pods == (("p4", SPOT),)
    # spot free for return-after: the spare goes to spot to take p1's (on-demand) place
    clocks = place(SETTINGS, whole, spot_free=1, on_demand_free=4, clocks=BackfillClocks(), now=T0).step.clocks
    assert place(SETTINGS, whole, spot_free=1, on_demand_free=4, clocks=clocks, now=at(299)).pods == ()
    swap = place(SETTINGS, whole, spot_free=1, on_demand_free=4, clocks=clocks, now=at(300))
    assert swap.pods == (("p4", SPOT),) and swap.step.swap
    # the spare placed and starting: no second swap until it is done
    started = [*whole[:4], PodFacts("p4", 4, SPOT)]
    assert place(SETTINGS, started, spot_free=1, on_demand_free=4, clocks=clocks, now=at(301)).pods == ()


def test_a_spare_needs_start_at_min():
    from spotguard.supervisor.policy import PolicyError, check_spare, parse_policy
    from spotguard.wire import names

    base = {names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true", names.ANN_FALLBACK: "on-demand",
            names.ANN_MAX_REPLICAS: "4"}
    policy = parse_policy(base, default_max=5)
    check_spare(policy, 4, places_pods=True)  # no spare
    check_spare(policy, 5, places_pods=False)  # the supervisor does not place its pods: not a spare
    try:
        check_spare(policy, 5, places_pods=True)
    except PolicyError as exc:
        assert exc.field == names.ANN_START_AT_MIN and "5 replicas" in exc.message
    else:
        raise AssertionError("a spare without start-at-min passed")
    check_spare(parse_policy({**base, names.ANN_START_AT_MIN: "true"}, default_max=5), 5, places_pods=True)


def test_a_running_pod_is_a_member_only_once_the_membership_lists_it():
    """A warm standby that runs but was not admitted yet is starting, not an (on-demand) member:
    otherwise a spot node coming back during its start-up gets a swap-back placed against it."""
    from spotguard.supervisor.capacity_type import BY_KEY, ON_DEMAND
    from spotguard.supervisor.placer import pod_facts

    label = BY_KEY["karpenter.sh/capacity-type"]

    def pod(node: str, phase: str = "Running") -> dict:
        return {"metadata": {"name": f"p-{node}"}, "spec": {"nodeName": node, "nodeSelector": {label.key: "on-demand"}},
                "status": {"phase": phase}}

    def facts(node: str, members: tuple[str, ...], phase: str = "Running", departing: tuple[str, ...] = ()):
        return pod_facts(pod(node, phase), label, known=True, departing=departing, members=members, hosts_mode="node")

    standby = facts("od-0", ("n0", "n1"))
    assert (standby.member, standby.leaving, standby.capacity) == (False, False, ON_DEMAND)
    assert facts("od-0", ("n0", "od-0")).member is True
    assert facts("od-0", ()).member is True  # no membership yet: the first group
    leaver = facts("n1", ("n0", "n1"), departing=("n1",))
    assert (leaver.member, leaver.leaving) == (False, True)
    assert facts("od-0", ("od-0",), phase="Pending").member is False
    unknown = pod_facts(pod("od-0"), label, known=False, departing=(), members=(), hosts_mode="node")
    assert (unknown.member, unknown.leaving) == (False, False)
    by_name = pod_facts(pod("od-0"), label, known=True, departing=(), members=("p-od-0",), hosts_mode="pod-name")
    assert by_name.member is True
    preempted = pod("od-0")  # the scheduler preempts it: Kubernetes takes it away (disruption.being_taken)
    preempted["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                          "reason": "PreemptionByScheduler"}]
    taken = pod_facts(preempted, label, known=True, departing=(), members=("od-0",), hosts_mode="node")
    assert (taken.member, taken.leaving) == (False, True)


CAPACITY = "karpenter.sh/capacity-type"


def backfill_world(pods: list[dict]):
    """A backfill Job `j` with the spare (max 2, parallelism 3, start at min) over the real cluster
    cache: spot nodes s0, s1 and one on-demand node od, and `pods` (see `replica`)."""
    from spotguard.supervisor.cluster_cache import ClusterCache
    from spotguard.supervisor.jobs import BY_KIND
    from spotguard.supervisor.placement import GATE
    from spotguard.supervisor.placer import Placer
    from spotguard.supervisor.policy import parse_policy
    from spotguard.wire import names

    either = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": CAPACITY, "operator": "In", "values": ["spot", "on-demand"]}]}]}}}
    annotations = {names.ANN_POLICY: "elastic", names.ANN_IN_PLACE: "true", names.ANN_FALLBACK: "on-demand",
                   names.ANN_MAX_REPLICAS: "2", names.ANN_START_AT_MIN: "true", names.ANN_MIN_REPLICAS: "1"}
    template = {"spec": {"affinity": either, "schedulingGates": [{"name": GATE}],
                         "containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    job = {"metadata": {"name": "j", "namespace": "train", "annotations": annotations},
           "spec": {"parallelism": 3, "completions": 3, "template": template}}

    def node(name: str, kind: str) -> dict:
        return {"metadata": {"name": name, "labels": {CAPACITY: kind}}, "spec": {},
                "status": {"allocatable": {"nvidia.com/gpu": "1"}, "conditions": [{"type": "Ready", "status": "True"}]}}

    adapters = dict(BY_KIND)
    cache = ClusterCache(adapters)
    cache.apply_node("SYNC", [node("s0", "spot"), node("s1", "spot"), node("od", "on-demand")])
    cache.apply_job(adapters["Job"], "SYNC", [job])
    cache.apply_pod("SYNC", pods)
    placer = Placer(cache, None)  # type: ignore[arg-type]  # plan() writes nothing

    def plan(departing=(), members_before=(), record=None):
        from spotguard.supervisor.record import Record

        return placer.plan(("Job", "train", "j"), job, adapters["Job"], parse_policy(annotations, default_max=3),
                           record or Record(), departing, T0, members_before)
    return plan


def replica(index: int, node_name: str | None, **status) -> dict:
    """Replica pod `j-<index>` (uid `u<index>`): bound to `node_name` on spot and Running, or gated."""
    from spotguard.supervisor.placement import GATE

    spec: dict = {"containers": [{"name": "t", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    spec.update({"nodeName": node_name, "nodeSelector": {CAPACITY: "spot"}} if node_name
                else {"schedulingGates": [{"name": GATE}]})
    return {"metadata": {"name": f"j-{index}", "namespace": "train", "uid": f"u{index}", "labels": {},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                         "ownerReferences": [{"kind": "Job", "name": "j", "controller": True,
                                              "apiVersion": "batch/v1"}]},
            "spec": spec, "status": {"phase": "Running" if node_name else "Pending", **status}}


def test_the_warm_standby_answers_only_a_departure():
    """The spare is placed for a member whose node departs (a reclaim), not for one whose node has
    a rebalance or a maintenance beyond the horizon (notice_policy): that member stays."""
    from spotguard.supervisor.placement import ON_DEMAND
    from spotguard.wire import names

    plan = backfill_world([replica(0, "s0"), replica(1, "s1"), replica(2, None)])
    _, whole = plan()  # a rebalance or a held maintenance
    assert whole is not None and whole.chosen.pods == ()
    record, departing = plan({"s0"})
    assert departing is not None and departing.chosen.pods == (("j-2", ON_DEMAND),)
    # the placement is a decision with its Event: the record says which pod went where and why
    assert (record.backfill_event, record.backfill_at) == (names.EVENT_WARM_STANDBY, T0)
    assert record.backfill == ("1 on-demand replica(s): warm standby for a leaving member (no spot slot free) "
                               "(j-2 on on-demand)")


PREEMPTED = {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}
PREEMPTOR = {"metadata": {"name": "serving-0", "namespace": "train", "uid": "serving"},  # takes the victim's GPU
             "spec": {"nodeName": "s0",
                      "containers": [{"name": "s", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
             "status": {"phase": "Running"}}


def test_a_member_kubernetes_takes_away_gets_its_standby_at_once():
    """A scheduler preemption of a member (DisruptionTarget) is a notice for that pod: its spare
    is placed at once, not after fallback-after (before: only a departing node counted). So is a
    member of the last membership whose pod is gone before a pass saw it go (the scheduler sets
    the condition and deletes the pod together), or is being deleted; not one that ended by
    itself, and not while the job is being suspended (its controller deletes the pods)."""
    from spotguard.supervisor.placement import ON_DEMAND
    from spotguard.supervisor.record import Record

    terminating = {**replica(0, "s0", **PREEMPTED)}
    terminating["metadata"] = {**terminating["metadata"], "deletionTimestamp": "2026-01-01T00:00:30Z"}
    for victim in (replica(0, "s0", **PREEMPTED), terminating):
        record, taken = backfill_world([victim, replica(1, "s1"), replica(2, None)])()
        assert taken is not None and taken.chosen.pods == (("j-2", ON_DEMAND),)
        assert "warm standby for a leaving member" in record.backfill
    members = ("u0/0", "u1/0")
    gone = backfill_world([PREEMPTOR, replica(1, "s1"), replica(2, None)])  # j-0 vanished, preempted
    record, placed = gone(members_before=members)
    assert placed is not None and placed.chosen.pods == (("j-2", ON_DEMAND),)
    assert record.backfill.startswith("1 on-demand replica(s): warm standby for a member that left (its pod is gone")
    assert gone(members_before=())[1].chosen.pods == ()  # being suspended, or no membership: below max only
    assert gone(members_before=("u1/0",))[1].chosen.pods == ()  # j-0 was no member
    deleting = {**replica(0, "s0")}
    deleting["metadata"] = {**deleting["metadata"], "deletionTimestamp": "2026-01-01T00:00:30Z"}
    assert backfill_world([deleting, replica(1, "s1"), replica(2, None)])(
        members_before=members)[1].chosen.pods == (("j-2", ON_DEMAND),)  # s0 is not free before it is gone
    ended = replica(0, "s0")
    ended["status"] = {"phase": "Failed"}  # exited by itself (a crash): its spot slot is free, spot first refills it
    assert backfill_world([ended, replica(1, "s1"), replica(2, None)])(
        members_before=members, record=Record())[1].chosen.pods == (("j-2", "spot"),)


def test_a_departure_is_answered_at_once_not_after_fallback_after():
    from spotguard.supervisor.disruption import departed

    left = plan(SETTINGS, BackfillView(spot=3, on_demand=0, departed=1, on_demand_free=4), BackfillClocks(), T0)
    assert (left.add_on_demand, left.standby) == (1, 1) and "a member that left" in left.reason
    short = plan(SETTINGS, BackfillView(spot=3, on_demand=0, on_demand_free=4), BackfillClocks(), T0)
    assert (short.add_on_demand, short.recheck_at) == (0, at(120))  # below max without a departure: waits
    assert not plan(SETTINGS, BackfillView(spot=4, on_demand=1, departed=1, spot_free=1), BackfillClocks(
        spot_free_since=at(-300)), T0).swap  # no swap-back while a departure is answered
    pods = [{"metadata": {"uid": "a"}}, {"metadata": {"uid": "b", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
            {"metadata": {"uid": "c", "deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"nodeName": "n"},
             "status": {"phase": "Running", **PREEMPTED}}]
    assert departed(("a/0", "b/0", "c/0", "d/1"), pods) == 2  # b deleted, d gone; c is taken away (leaving)


def test_each_placement_has_its_event():
    from spotguard.supervisor.backfill import BackfillStep
    from spotguard.supervisor.placer import placement_event
    from spotguard.wire import names

    assert placement_event(BackfillStep(add_spot=2)) == names.EVENT_PLACED_ON_SPOT
    assert placement_event(BackfillStep(add_on_demand=2)) == names.EVENT_BACKFILLED
    assert placement_event(BackfillStep(add_on_demand=1, standby=1)) == names.EVENT_WARM_STANDBY
    assert placement_event(BackfillStep(add_spot=1, standby=1)) == names.EVENT_WARM_STANDBY  # on trusted spot
    assert placement_event(BackfillStep(swap=True)) == names.EVENT_SWAPPING_TO_SPOT
    # the plan says how many of its replicas are standbys, on either capacity
    trusted = plan(SETTINGS, BackfillView(spot=3, on_demand=0, leaving=1, spot_free=2, on_demand_free=4),
                   BackfillClocks(spot_free_since=at(-300)), T0)
    assert (trusted.add_spot, trusted.standby) == (1, 1)
    assert trusted.reason.startswith("1 spot replica(s): warm standby")
    short = plan(SETTINGS, BackfillView(spot=2, on_demand=0, leaving=1, spot_free=1, on_demand_free=4),
                 BackfillClocks(), T0)
    assert (short.add_spot, short.add_on_demand, short.standby) == (1, 1, 1)
    assert short.reason == ("1 spot replica(s) for free spot slots; 1 on-demand replica(s): warm standby for a "
                            "leaving member (spot free for less than return-after 300s)")
