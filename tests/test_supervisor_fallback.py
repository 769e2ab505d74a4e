"""Pure parts of the on-demand fallback: annotations, the capacity-type table, the template
switch, affinity in capacity, the move decisions, the steps lost of drained pods, cost restore."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, UTC

import pytest

from spotguard.supervisor import capacity, capacity_type, progress
from spotguard.supervisor.cost import CostLedger, PriceTable
from spotguard.supervisor.fallback import Fallback, parse_duration
from spotguard.supervisor.policy import (MOVE, NONE, RECORD, RESUME, SUSPEND, JobState, NoticeHit, Policy,
                                         PolicyError, Settings, decide, parse_policy)
from spotguard.supervisor.record import Record, parse_record
from spotguard.wire import names

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
FB = Policy("fixed", 2, 2, None, Fallback(after=10.0, return_after=5.0))
SPOT = {"template": {"nodeSelector": {"karpenter.sh/capacity-type": "spot", "pool": "a"}, "affinity": None,
                     "tolerations": None}}
ON_DEMAND = {"template": {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand", "pool": "a"}, "affinity": None,
                          "tolerations": None}}


def _suspended(**changes) -> Record:
    return Record(phase="Suspended", decided_at=T0, waiting_since=T0, lacking_since=T0, replicas=2, key="k", **changes)


def _state(record: Record, **kw) -> JobState:
    base = dict(policy=FB, replicas=2, suspended=record.phase == "Suspended", record=record, directives=SPOT,
                template_mutable=True)
    return JobState(**{**base, **kw})


@pytest.mark.parametrize("text,seconds", [("2s", 2.0), ("10m", 600.0), ("1h30m", 5400.0), ("500ms", 0.5), ("90", 90.0)])
def test_parse_duration(text, seconds):
    assert parse_duration("f", text) == seconds


@pytest.mark.parametrize("annotations,field_name", [
    ({names.ANN_FALLBACK: "spot"}, names.ANN_FALLBACK),
    ({names.ANN_FALLBACK: "on-demand", names.ANN_FALLBACK_AFTER: "10 minutes"}, names.ANN_FALLBACK_AFTER),
    ({names.ANN_FALLBACK: "on-demand", names.ANN_RETURN_AFTER: "0s"}, names.ANN_RETURN_AFTER),
])
def test_fallback_annotation_errors_name_the_annotation(annotations, field_name):
    with pytest.raises(PolicyError) as err:
        parse_policy(annotations, 2)
    assert err.value.field == field_name


def test_fallback_defaults():
    assert parse_policy({names.ANN_FALLBACK: "on-demand"}, 2).fallback == Fallback(600.0, 300.0)
    assert parse_policy({}, 2).fallback is None


@pytest.mark.parametrize("directives,expected", [
    ({"nodeSelector": {"eks.amazonaws.com/capacityType": "SPOT"}},
     {"nodeSelector": {"eks.amazonaws.com/capacityType": "ON_DEMAND"}}),
    ({"nodeSelector": {"cloud.google.com/gke-spot": "true", "x": "y"}},
     {"nodeSelector": {"x": "y"}, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [
             {"key": "cloud.google.com/gke-spot", "operator": "NotIn", "values": ["true"]}]}]}}}}),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [
            {"key": "kubernetes.azure.com/scalesetpriority", "operator": "In", "values": ["spot"]}]}]}}}},
     {"nodeSelector": None, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
         "nodeSelectorTerms": [{"matchExpressions": [
             {"key": "kubernetes.azure.com/scalesetpriority", "operator": "NotIn", "values": ["spot"]}]}]}}}}),
])
def test_to_on_demand_switches_each_clouds_spot_selection(directives, expected):
    out = capacity_type.to_on_demand(directives)
    assert {k: v for k, v in out.items() if v is not None} == {k: v for k, v in expected.items() if v is not None}


def test_to_on_demand_without_spot_selection_is_none():
    assert capacity_type.to_on_demand({"nodeSelector": {"pool": "a"}}) is None


def test_merge_patch_restores_exactly():
    current = {"nodeSelector": {"a": "1"}, "affinity": {"nodeAffinity": {"x": 1}}, "tolerations": None}
    desired = {"nodeSelector": {"a": "2", "b": "3"}, "affinity": None, "tolerations": [{"key": "t"}]}
    assert capacity_type.merge_patch(current, desired) == {"nodeSelector": {"a": "2", "b": "3"}, "affinity": None,
                                                           "tolerations": [{"key": "t"}]}


def test_capacity_evaluates_required_node_affinity():
    node = {"metadata": {"labels": {"cloud.google.com/gke-spot": "true"}}}
    spec = capacity_type.to_on_demand({"nodeSelector": {"cloud.google.com/gke-spot": "true"}})
    assert not capacity.node_matches(node, spec)
    assert capacity.node_matches({"metadata": {"labels": {}}}, spec)


def test_cost_reads_the_same_table():
    table = PriceTable()
    node = {"metadata": {"labels": {"cloud.google.com/gke-provisioning": "spot"}}}
    assert table.capacity_type(node) == "spot"


def test_fallback_waits_for_fallback_after_then_moves_to_on_demand():
    state = _state(_suspended(), free_slots=0, alt_slots=2)
    early = decide(state, T0 + timedelta(seconds=5), Settings())
    assert early.action == NONE and early.recheck_at == T0 + timedelta(seconds=10)
    move = decide(state, T0 + timedelta(seconds=10), Settings())
    assert move.action == MOVE and move.replicas == 2
    assert move.directives == ON_DEMAND
    assert move.record.capacity == "on-demand" and move.record.spot_directives == SPOT
    assert move.record.event == names.EVENT_FELL_BACK


def test_fallback_needs_on_demand_capacity_and_a_mutable_template():
    now = T0 + timedelta(seconds=30)
    assert decide(_state(_suspended(), alt_slots=1), now, Settings()).action == NONE
    assert decide(_state(_suspended(), alt_slots=2, template_mutable=False), now, Settings()).action == NONE


def test_spot_capacity_back_before_fallback_resumes_on_spot():
    later = T0 + timedelta(seconds=30)
    assert decide(_state(_suspended(), free_slots=2, alt_slots=2), later, Settings()).action == RESUME


def _on_demand(**changes) -> Record:
    return Record(**{"phase": "Running", "decided_at": T0, "capacity": "on-demand", "spot_directives": SPOT,
                     "replicas": 2, "key": "m", **changes})


def test_return_waits_for_return_after_of_free_spot_capacity_then_drains():
    start = decide(_state(_on_demand(), directives=ON_DEMAND, alt_slots=2), T0, Settings())
    assert start.action == RECORD and start.record.spot_free_since == T0
    waiting = _on_demand(spot_free_since=T0)
    too_soon = T0 + timedelta(seconds=4)
    assert decide(_state(waiting, directives=ON_DEMAND, alt_slots=2), too_soon, Settings()).action == NONE
    drain = decide(_state(waiting, directives=ON_DEMAND, alt_slots=2), T0 + timedelta(seconds=5), Settings())
    assert drain.action == RECORD and drain.record.phase == "Checkpointing" and drain.record.move_to == "spot"
    assert drain.record.drain and drain.record.generation == waiting.generation + 1


def test_the_return_after_clock_steps_say_what_they_do():
    """Each RECORD step of the return-after clock is logged with its message: none is empty."""
    start = decide(_state(_on_demand(), directives=ON_DEMAND, alt_slots=2), T0, Settings())
    assert "free" in start.message and "return-after 5s" in start.message and start.reason
    busy = decide(_state(_on_demand(spot_free_since=T0), directives=ON_DEMAND, alt_slots=1), T0, Settings())
    assert busy.action == RECORD and busy.record.spot_free_since is None
    assert "starts over" in busy.message and busy.reason


def test_return_never_while_a_notice_is_live():
    waiting = _on_demand(spot_free_since=T0)
    hit = (NoticeHit("gcp:1", "od-1", "maintenance", None),)
    out = decide(
        _state(waiting, directives=ON_DEMAND, alt_slots=2, notices=hit), T0 + timedelta(seconds=60), Settings())
    assert out.action == RECORD and out.record.spot_free_since is None and out.record.phase == "Running"


def test_return_suspends_after_the_drain_then_restores_the_spot_directives():
    draining = _on_demand(
        phase="Checkpointing", move_to="spot", drain="d", checkpoint_deadline=T0 + timedelta(seconds=60))
    assert decide(_state(draining, directives=ON_DEMAND, alt_slots=2), T0, Settings()).action == NONE
    suspend = decide(_state(draining, directives=ON_DEMAND, alt_slots=2, drained=True), T0, Settings())
    assert suspend.action == SUSPEND and suspend.record.move_to == "spot"
    moving = suspend.record
    blocked = decide(
        _state(moving, suspended=True, directives=ON_DEMAND, alt_slots=2, template_mutable=False), T0, Settings())
    assert blocked.action == NONE
    back = decide(_state(moving, suspended=True, directives=ON_DEMAND, alt_slots=2), T0, Settings())
    assert back.action == MOVE and back.directives == SPOT and back.record.capacity == ""
    assert back.record.spot_directives is None and back.record.event == names.EVENT_RETURNED


def test_record_round_trips_fallback_fields():
    rec = _on_demand(spot_free_since=T0, cost={"cost": 1.5}, steps_lost=3, counted_exits=("u/c/t",))
    assert parse_record(rec.to_json()) == rec


def test_steps_lost_counted_once_per_drain_from_termination_messages():
    def pod(uid, lost):
        term = {"exitCode": 83, "finishedAt": "2026-01-02T03:04:06Z", "message": json.dumps({"steps_lost": lost})}
        return {
            "metadata": {"uid": uid},
            "status": {"containerStatuses": [{"name": "c", "lastState": {"terminated": term}}]},
        }

    total, counted = progress.count_steps_lost([pod("a", 3), pod("b", 3)], 1, ())
    assert total == 4 and len(counted) == 2
    assert progress.count_steps_lost([pod("a", 3), pod("b", 3)], total, counted) is None


def test_drained_exits_before_since_do_not_count():
    term = {"exitCode": 83, "finishedAt": "2026-01-02T03:04:00Z"}
    pods = [{"metadata": {"uid": "a"}, "status": {"containerStatuses": [{"name": "c", "state": {"terminated": term}}]}}]
    assert list(progress.drained_exits(pods, T0)) == []
    assert len(list(progress.drained_exits(pods, T0 - timedelta(seconds=10)))) == 1


def test_cost_ledger_restores_saved_totals_once():
    ledger = CostLedger()
    ledger.restore("job", {"spot_hours": 2.0, "on_demand_hours": 1.0, "cost": 5.0, "on_demand_equivalent": 9.0})
    assert ledger.jobs["job"].on_demand_hours == 1.0 and ledger.jobs["job"].totals()["cost"] == 5.0
    ledger.restore("job", {"cost": 99.0})
    assert ledger.jobs["job"].cost == 5.0


def test_the_moves_are_rows_of_the_policys_transitions():
    from spotguard.supervisor import fallback, fallback_moves, policy

    rows = policy.TRANSITIONS
    start = rows.index(fallback_moves.ROWS[0])
    assert rows[start:start + len(fallback_moves.ROWS)] == fallback_moves.ROWS  # in order, before the wait
    assert not hasattr(fallback, "decide_move")


# name, record, state changes, seconds after T0, action, record reason (or the note's reason)
MOVES = [
    ("suspended, spot short, before fallback-after: the policy waits", _suspended(), {"alt_slots": 2}, 5, NONE, ""),
    ("suspended, spot short, fallback-after passed: move", _suspended(), {"alt_slots": 2}, 10, MOVE,
     "FellBackToOnDemand"),
    ("... but no on-demand either: the policy waits", _suspended(), {"alt_slots": 1}, 10, NONE, ""),
    ("on-demand, spot free: the return-after clock starts", _on_demand(),
     {"directives": ON_DEMAND, "alt_slots": 2}, 0, RECORD, "SpotFree"),
    ("on-demand, spot gone again: the clock starts over", _on_demand(spot_free_since=T0),
     {"directives": ON_DEMAND, "alt_slots": 0}, 1, RECORD, "SpotBusyAgain"),
    ("on-demand, spot free for return-after: drain", _on_demand(spot_free_since=T0),
     {"directives": ON_DEMAND, "alt_slots": 2}, 5, RECORD, "ReturningToSpot"),
    ("draining, timeout passed: suspend", _on_demand(phase="Checkpointing", move_to="spot", drain="d",
                                                     checkpoint_deadline=T0 + timedelta(seconds=3)),
     {"directives": ON_DEMAND, "alt_slots": 2}, 3, SUSPEND, "Moving"),
    ("moving, spot capacity gone: resume where it was", _on_demand(phase="Suspended", move_to="spot"),
     {"directives": ON_DEMAND, "suspended": True, "alt_slots": 0, "free_slots": 2}, 0, RESUME, "ReturnAbandoned"),
    ("moving, nothing free: wait", _on_demand(phase="Suspended", move_to="spot"),
     {"directives": ON_DEMAND, "suspended": True}, 0, NONE, ""),
]


@pytest.mark.parametrize("name, record, changes, offset, action, reason", MOVES, ids=[m[0] for m in MOVES])
def test_the_move_rows(name, record, changes, offset, action, reason):
    decision = decide(_state(record, **changes), T0 + timedelta(seconds=offset), Settings())
    why = decision.record.reason if decision.key else decision.reason  # a clock's note has no key
    assert (decision.action, why if decision.acts else "") == (action, reason)
