"""Pure parts of the supervisor: policy parsing, decisions, capacity, cost, record, conditions."""
from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest

from spotguard.config import ConfigError
from spotguard.supervisor import capacity, conditions
from spotguard.supervisor.cost import CostLedger, PriceTable
from spotguard.supervisor.policy import (NONE, RECORD, RESUME, SCALE, SUSPEND, JobState, NoticeHit, Policy, PolicyError,
                                         Settings, decide, parse_policy)
from spotguard.supervisor.record import Record, RecordError, parse_record
from spotguard.wire import names

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
EL = Policy("elastic", 2, 4, None)
FX = Policy("fixed", 4, 4, None)
HIT = (NoticeHit("aws.spot:1", "n0", "reclaim", T0 + timedelta(seconds=120)),)


@pytest.mark.parametrize("annotations,default_max,expected", [
    ({}, 4, Policy("fixed", 4, 4, None)),
    ({names.ANN_POLICY: "elastic"}, 4, Policy("elastic", 1, 4, None)),
    ({names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2", names.ANN_MAX_REPLICAS: "8", names.ANN_MAX_WAIT: "600"},
     4, Policy("elastic", 2, 8, 600.0)),
])
def test_parse_policy(annotations, default_max, expected):
    assert parse_policy(annotations, default_max) == expected


@pytest.mark.parametrize("annotations,field_name", [
    ({names.ANN_POLICY: "bogus"}, names.ANN_POLICY),
    ({names.ANN_MIN_REPLICAS: "-1"}, names.ANN_MIN_REPLICAS),
    ({names.ANN_MAX_REPLICAS: "1.5"}, names.ANN_MAX_REPLICAS),
    ({names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "9"}, names.ANN_MIN_REPLICAS),
    ({names.ANN_MAX_WAIT: "nan"}, names.ANN_MAX_WAIT),
    ({names.ANN_MAX_WAIT: "0"}, names.ANN_MAX_WAIT),
])
def test_parse_policy_errors_name_the_annotation(annotations, field_name):
    with pytest.raises(PolicyError) as err:
        parse_policy(annotations, 4)
    assert err.value.field == field_name and isinstance(err.value, ConfigError)


NO_RECORD = Record()


def state(policy=EL, replicas=4, suspended=False, record=NO_RECORD, notices=(), healthy=4, free=0, drained=False):
    return JobState(policy, replicas, suspended, record, tuple(notices), healthy, free, drained)


CASES = [
    # name, state, now offset (s), expected action, expected replicas, expected phase
    ("elastic notice -> survivors", state(notices=HIT, healthy=3), 0, SCALE, 3, "Running"),
    ("elastic notice below min -> suspend", state(notices=HIT, healthy=1), 0, SUSPEND, 4, "Suspended"),
    ("elastic handled notice -> nothing", state(notices=HIT, healthy=3, replicas=3,
                                                record=Record(handled=("aws.spot:1",), decided_at=T0)),
     5, NONE, None, "Running"),
    ("elastic capacity back, too soon", state(replicas=3, healthy=3, free=1, record=Record(decided_at=T0)),
     1, NONE, None, "Running"),
    ("elastic capacity back -> scale out", state(replicas=3, healthy=3, free=5, record=Record(decided_at=T0)),
     60, SCALE, 4, "Running"),
    ("fixed notice -> checkpoint wait", state(policy=FX, notices=HIT, healthy=3), 0, RECORD, 4, "Checkpointing"),
    ("fixed drained -> suspend", state(policy=FX, drained=True, record=Record(phase="Checkpointing", decided_at=T0,
                                       checkpoint_deadline=T0 + timedelta(seconds=100), replicas=4,
                                       handled=("aws.spot:1",))),
     1, SUSPEND, 4, "Suspended"),
    ("fixed deadline -> suspend", state(policy=FX, record=Record(phase="Checkpointing", decided_at=T0,
                                        checkpoint_deadline=T0 + timedelta(seconds=10), replicas=4)),
     11, SUSPEND, 4, "Suspended"),
    ("fixed suspended, partial capacity", state(policy=FX, suspended=True, free=3,
                                                record=Record(phase="Suspended", replicas=4, decided_at=T0)),
     5, NONE, None, "Suspended"),
    ("fixed suspended, capacity -> resume", state(policy=FX, suspended=True, free=4,
                                                  record=Record(phase="Suspended", replicas=4, decided_at=T0)),
     5, RESUME, 4, "Running"),
    ("max-wait expiry -> give up", state(policy=Policy("elastic", 3, 4, 30.0), suspended=True, free=2,
                                         record=Record(phase="Suspended", waiting_since=T0, decided_at=T0)),
     31, RECORD, None, "GaveUp"),
    ("gave up stays", state(suspended=True, free=9, record=Record(phase="GaveUp", decided_at=T0)),
     99, NONE, None, "GaveUp"),
    ("suspended by the user: hands off", state(suspended=True, free=9, notices=HIT), 0, NONE, None, "Running"),
]


@pytest.mark.parametrize("name,st,offset,action,replicas,phase", CASES, ids=[c[0] for c in CASES])
def test_decide_table(name, st, offset, action, replicas, phase):
    decision = decide(st, T0 + timedelta(seconds=offset), Settings(checkpoint_timeout=60, scale_out_delay=30), "me")
    assert decision.action == action
    if replicas is not None:
        assert decision.record.replicas == replicas
    assert decision.record.phase == phase
    if decision.acts:
        assert decision.key and decision.record.key == decision.key and decision.record.decided_by == "me"
        # same state, same time -> same decision (what a restarted supervisor relies on)
        settings = Settings(checkpoint_timeout=60, scale_out_delay=30)
        assert decide(st, T0 + timedelta(seconds=offset), settings, "me") == decision


def test_record_round_trip_and_bad_records():
    rec = Record(phase="Suspended", reason="BelowMin", decided_at=T0, handled=("a", "b"), replicas=3, waiting_since=T0,
                 members=("n1",), generation=2)
    assert parse_record(rec.to_json()) == rec
    assert parse_record(None) == Record()
    for bad in ("{", '{"v": 2}', '{"v": 1, "phase": "Dancing"}', '{"v": 1, "replicas": -1}', '[]'):
        with pytest.raises(RecordError):
            parse_record(bad)


def test_conditions_follow_the_record_and_keep_others():
    other = {"type": "Complete", "status": "False"}
    rec = Record(phase="Suspended", reason="BelowMin", message="m", decided_at=T0)
    first = conditions.merged([other], rec, T0)
    assert first[0] == other and first[1]["type"] == names.COND_SUSPENDED and first[1]["status"] == "True"
    assert conditions.merged(first, rec, T0 + timedelta(seconds=5)) is None  # nothing to change
    gave_up = conditions.merged(first, rec.with_(phase="GaveUp", reason="MaxWaitExceeded"), T0)
    assert {c["type"]: c["status"] for c in gave_up}[names.COND_MAX_WAIT] == "True"


def node(name, gpus="4", ready=True, taints=(), labels=None, annotations=None, unschedulable=False):
    return {"metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"taints": list(taints), "unschedulable": unschedulable},
            "status": {"allocatable": {"nvidia.com/gpu": gpus, "cpu": "16", "memory": "64Gi"},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pod(gpus="1", cpu="1", memory="1Gi"):
    requests = {"nvidia.com/gpu": gpus, "cpu": cpu, "memory": memory}
    return {"spec": {"containers": [{"resources": {"requests": requests}}]}, "status": {"phase": "Running"}}


def test_capacity_counts_only_healthy_matching_nodes():
    spec = pod("2")["spec"] | {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    nodes = [
        node("ok", labels={"pool": "gpu"}, taints=[{"key": "gpu", "effect": "NoSchedule"}]),  # 4 GPUs, 1 used -> 1 more
        node("notice", labels={"pool": "gpu"}, annotations={names.ANN_NOTICE: "{}"}),
        node("tainted", labels={"pool": "gpu"},
             taints=[{"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"}]),
        node("other-pool", labels={"pool": "cpu"}),
        node("not-ready", labels={"pool": "gpu"}, ready=False),
        node("cordoned", labels={"pool": "gpu"}, unschedulable=True),
        node("untolerated", labels={"pool": "gpu"}, taints=[{"key": "x", "effect": "NoExecute"}]),
        node("fresh", labels={"pool": "gpu"}, gpus="8"),  # 4 more
    ]
    assert capacity.free_slots(nodes, {"ok": [pod("2")]}, spec) == 1 + 4
    assert capacity.parse_quantity("500m") == 0.5 and capacity.parse_quantity("2Gi") == 2 * 2**30
    assert capacity.parse_quantity("1e3") == 1000


def test_cost_ledger_spot_vs_on_demand():
    prices = PriceTable.from_mapping({"default": {"spot": 1.0, "on-demand": 3.0},
                                      "instance-types": {"p4d": {"spot": 10.0, "on-demand": 30.0}}})
    spot = node("s", labels={"karpenter.sh/capacity-type": "spot", "node.kubernetes.io/instance-type": "p4d"})
    od = node("o", labels={"node.kubernetes.io/instance-type": "m5"})
    ledger = CostLedger(prices)
    ledger.observe("job", [spot, od], 0.0)
    entry = ledger.observe("job", [spot], 3600.0)
    assert entry.spot_hours == 1.0 and entry.on_demand_hours == 1.0
    assert entry.cost == 10.0 + 3.0 and entry.on_demand_equivalent == 30.0 + 3.0
    assert entry.savings_ratio == pytest.approx(1 - 13 / 33)
    for bad, field_name in (({"default": {"spot": -1}}, "default.spot"), ({"bogus": 1}, "bogus"),
                            ({"instance-types": {"x": 5}}, "instance-types.x")):
        with pytest.raises(ConfigError) as err:
            PriceTable.from_mapping(bad)
        assert field_name in str(err.value)
