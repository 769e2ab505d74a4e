"""Pure parts of the supervisor: policy parsing, decisions, capacity, cost, record, conditions."""
from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest

from spotguard.config import ConfigError
from spotguard.supervisor import capacity, conditions
from spotguard.supervisor.cost import CostLedger, PriceTable
from spotguard.supervisor.policy import (NONE, RECORD, RESUME, SCALE, SUSPEND, JobState, NoticeHit, Policy, PolicyError,
                                         Settings, decide, parse_policy)
from spotguard.supervisor.job_notices import read_job
from spotguard.supervisor.membership_plan import JobPods
from spotguard.supervisor.record import Record, RecordError, parse_record
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, Severity

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


def test_the_suspended_condition_says_why_it_is_false_not_the_last_notice():
    """SpotguardSuspended=False is about the suspension: a notice left in place is not its message."""
    left = Record(phase="Running", reason="NoticeLeavingInPlace", decided_at=T0,
                  message="notice aws.spot:n2 on n2: its replicas leave in place")
    suspended = {c["type"]: c for c in conditions.wanted(left)}[names.COND_SUSPENDED]
    assert (suspended["status"], suspended["reason"], suspended["message"]) == \
        ("False", "Running", "spotguard does not keep the job suspended")
    waiting = left.with_(phase="Checkpointing", message="notice r1 on n2: waiting for the checkpoint")
    checkpointing = {c["type"]: c for c in conditions.wanted(waiting)}[names.COND_SUSPENDED]
    assert (checkpointing["reason"], checkpointing["message"]) == \
        ("Checkpointing", "suspended once the checkpoint is taken: notice r1 on n2: waiting for the checkpoint")
    # a new decision that does not change the suspension does not rewrite the condition
    first = conditions.merged([], left, T0)
    assert conditions.merged(first, left.with_(message="notice r2 on n3: leave in place"), T0) is None


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


# ---- notices read through spotguard.wire.notice_policy (job_notices.py) --------------------------
def _notice(kind: str, lead: float | None, *, nid: str = "n", node: str = "n0", advisory: bool = False) -> Notice:
    deadline = None if lead is None else T0 + timedelta(seconds=lead)
    return Notice(nid, Kind(kind), "aws.spot", node, T0, deadline=deadline,
                  severity=Severity.ADVISORY if advisory else Severity.ACT)


def _replica(name: str, node: str, **status) -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {"nodeName": node},
            "status": {"phase": "Running", **status}}


# (the notice on n0 (kind, seconds to its deadline; None: no notice), departs, survivors of 3, release after T0 (s))
READINGS = [
    (None, False, 3, None),
    (("reclaim", 120.0), True, 2, None),  # AWS's 2 minutes: a departure at once
    (("reclaim", None), True, 2, None),
    (("maintenance", 600.0), False, 3, 480.0),  # held: its replica survives until deadline - 120 s
    (("maintenance", 119.0), True, 2, None),
    (("rebalance", None), False, 3, None),  # a risk, not a departure: its replica still counts
    (("gpu-fault", None), True, 2, None),
    (("drain", 30.0), True, 2, None),
]


@pytest.mark.parametrize("notice, departs, survivors, release_in", READINGS)
def test_which_notices_hit_a_job_and_who_survives(notice, departs, survivors, release_in):
    pods = [_replica("a", "n0"), _replica("b", "n1"), _replica("c", "n2")]
    notices = {"n0": None if notice is None else _notice(*notice), "n1": None, "n2": None}
    reading = read_job(pods, lambda p: True, notices, T0)
    assert [h.node for h in reading.hits] == (["n0"] if departs else [])
    assert reading.departing == (frozenset({"n0"}) if departs else frozenset())
    assert reading.healthy == survivors
    assert reading.release_at == (None if release_in is None else T0 + timedelta(seconds=release_in))


def test_an_advisory_an_unknown_node_and_a_disrupted_pod():
    evicted = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    pods = [_replica("a", "n0"), _replica("b", "gone"), _replica("c", "n2", conditions=evicted)]
    reading = read_job(pods, lambda p: True, {"n0": _notice("reclaim", 30.0, advisory=True), "n2": None}, T0)
    assert reading.healthy == 1  # a: advisory only; b: its node is unknown; c: taken away
    assert [(h.id.split("/")[0], h.from_node) for h in reading.hits] == [("EvictionByEvictionAPI", False)]


@pytest.mark.parametrize("policy", [EL, FX, Policy("elastic", 2, 4, None, in_place=True)], ids=str)
def test_a_held_notice_changes_nothing_and_is_looked_at_again_at_its_release(policy):
    release = T0 + timedelta(seconds=480)
    held = JobState(policy, 4, False, Record(), (), healthy_replicas=4, release_at=release)
    decision = decide(held, T0)
    assert decision.action == NONE and decision.record == Record() and decision.recheck_at == release


# ---- the checkpoint wait ends when its notices are withdrawn -------------------------------------
WAITING = Record(phase="Checkpointing", decided_at=T0, key="k", replicas=4, handled=("old", "m1"),
                 checkpoint_deadline=T0 + timedelta(seconds=100), awaiting={"m1": "n0"})
LIVE = (NoticeHit("m1", "n0", "maintenance", T0 + timedelta(seconds=100)),)


def pods_on(*nodes: str) -> JobPods:
    return JobPods(nodes=frozenset(nodes))


# name, record, live departing notices, drained, known nodes, seconds after T0, action, phase, reason
WITHDRAWALS = [
    ("still live: wait", WAITING, LIVE, False, ("n0",), 5, NONE, "Checkpointing", ""),
    ("withdrawn: keeps running", WAITING, (), False, ("n0",), 5, RECORD, "Running", "NoticeWithdrawn"),
    ("withdrawn after the stale deadline: still keeps running", WAITING, (), False, ("n0",), 200, RECORD, "Running",
     "NoticeWithdrawn"),
    ("a replica drained first: the checkpoint exists, suspend", WAITING, (), True, ("n0",), 5, SUSPEND, "Suspended",
     "Checkpointed"),
    ("the node is gone: it departed, wait for the deadline", WAITING, (), False, (), 5, NONE, "Checkpointing", ""),
    ("the node is gone at the deadline: suspend", WAITING, (), False, (), 100, SUSPEND, "Suspended", "DeadlineReached"),
    ("a pod taken away is never withdrawn", WAITING.with_(awaiting={"Evict/p/u": ""}), (), False, ("n0",), 5, NONE,
     "Checkpointing", ""),
    ("one of two withdrawn: wait on", WAITING.with_(awaiting={"m1": "n0", "m2": "n1"}, handled=("m1", "m2")),
     (NoticeHit("m2", "n1", "reclaim"),), False, ("n0", "n1"), 5, NONE, "Checkpointing", ""),
    ("a record from before `awaiting`: wait as before", WAITING.with_(awaiting=None), (), False, ("n0",), 5, NONE,
     "Checkpointing", ""),
    ("no view of the nodes (a model without pods): wait as before", WAITING, (), False, None, 5, NONE,
     "Checkpointing", ""),
]


@pytest.mark.parametrize("name, rec, live, drained, nodes, offset, action, phase, reason", WITHDRAWALS,
                         ids=[w[0] for w in WITHDRAWALS])
def test_a_withdrawn_notice_ends_the_checkpoint_wait(name, rec, live, drained, nodes, offset, action, phase, reason):
    st = JobState(FX, 4, False, rec, live, 4, 0, drained, pods=None if nodes is None else pods_on(*nodes))
    decision = decide(st, T0 + timedelta(seconds=offset), Settings(), "me")
    assert (decision.action, decision.record.phase, decision.record.reason if decision.acts else "") == \
        (action, phase, reason)
    if reason == "NoticeWithdrawn":
        assert decision.reason == names.EVENT_NOTICE_WITHDRAWN and "withdrawn" in decision.message
        assert decision.record.handled == ("old",)  # the notice acts again if it comes back
        assert decision.record.awaiting is None and decision.record.checkpoint_deadline is None
        assert decision.record.reclaims_survived == rec.reclaims_survived


def test_the_checkpoint_wait_records_what_it_waits_for():
    hits = (NoticeHit("m1", "n0", "maintenance", T0 + timedelta(seconds=100)),
            NoticeHit("Evict/p/u", "n1", "drain", None, from_node=False))
    first = decide(JobState(FX, 4, False, Record(), hits[:1], 3), T0)
    assert first.record.awaiting == {"m1": "n0"} and first.record.checkpoint_deadline == T0 + timedelta(seconds=100)
    further = decide(JobState(FX, 4, False, first.record, hits, 2), T0 + timedelta(seconds=1))
    assert further.reason == names.EVENT_NOTED and further.record.awaiting == {"m1": "n0", "Evict/p/u": ""}
    assert parse_record(further.record.to_json()) == further.record


def test_a_released_notice_says_since_when_it_departs():
    """The notice-to-patch latency of a maintenance announced 10 minutes ahead counts from its
    release, not from its announcement."""
    notices = {"n0": _notice("maintenance", 600.0), "n1": _notice("reclaim", 120.0, nid="r", node="n1")}
    reading = read_job([_replica("a", "n0"), _replica("b", "n1")], lambda p: True, notices,
                       T0 + timedelta(seconds=500))
    assert {h.id: h.released_at for h in reading.hits} == {"n": T0 + timedelta(seconds=480), "r": None}


def test_the_job_reads_notices_with_the_horizon_its_guard_has():
    """The job's pod template sets SPOTGUARD_HORIZON_SECONDS for its Guard: the supervisor reads
    the job's notices with that horizon (the same function gives the sidecar its copy), so a
    maintenance 200 s ahead is a departure under a 300 s horizon and held under the default; a
    horizon the parts could read differently makes the policy invalid, naming the env entry."""
    def spec(*entries):
        env = [{"name": "SPOTGUARD_HORIZON_SECONDS", **e} for e in entries]
        return {"containers": [{"name": "trainer", "env": env}]}

    assert parse_policy({}, 4).horizon_seconds == 120.0
    policy = parse_policy({}, 4, pod_specs=[spec({"value": "300"})])
    assert policy.horizon_seconds == 300.0
    pods = [_replica("a", "n0"), _replica("b", "n1")]
    notices = {"n0": _notice("maintenance", 200.0), "n1": None}
    held = read_job(pods, lambda p: True, notices, T0)
    assert held.departing == frozenset() and held.release_at == T0 + timedelta(seconds=80)
    departs = read_job(pods, lambda p: True, notices, T0, policy.horizon_seconds)
    assert departs.departing == {"n0"} and departs.healthy == 1 and departs.release_at is None
    assert departs.hits[0].released_at is None  # under its horizon it departed from its detection
    for bad in ({"value": "0"}, {"value": "soon"}, {"valueFrom": {"configMapKeyRef": {"name": "c", "key": "h"}}}):
        with pytest.raises(PolicyError) as info:
            parse_policy({}, 4, pod_specs=[spec(bad)])
        assert info.value.field == "spec.containers[].env[SPOTGUARD_HORIZON_SECONDS]"
    empty = parse_policy({}, 4, pod_specs=[spec({"value": ""})])
    assert empty.horizon_seconds == 120.0  # empty: unset, as the Guard reads it
    two = {"containers": [{"env": [{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "30"}]},
                          {"env": [{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "60"}]}]}
    with pytest.raises(PolicyError, match="differently"):
        parse_policy({}, 4, pod_specs=[two])


def test_every_role_of_a_pytorchjob_must_hold_notices_alike():
    """A PyTorchJob's Master runs a Guard too: its template's horizon is read with the Workers'
    (JobAdapter.role_pod_specs), and a Master that holds notices by another one (set otherwise,
    or not set while the Workers set one) makes the policy invalid; a container that sets none
    inside one pod (a logger) is not read."""
    from spotguard.supervisor.jobs.pytorch import PyTorchJobAdapter

    def role(value):
        env = [] if value is None else [{"name": "SPOTGUARD_HORIZON_SECONDS", "value": value}]
        return {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch", "env": env},
                                                                    {"name": "logger", "image": "l"}]}}}

    def policy(master, worker):
        job = {"spec": {"pytorchReplicaSpecs": {"Master": role(master), "Worker": role(worker)}}}
        return parse_policy({}, 4, pod_specs=PyTorchJobAdapter().role_pod_specs(job))

    assert policy("300", "300").horizon_seconds == 300.0
    assert policy(None, None).horizon_seconds == 120.0
    for master, worker in (("30", "300"), (None, "300")):
        with pytest.raises(PolicyError, match="different horizons"):
            policy(master, worker)


def test_a_horizon_beyond_the_calendar_reads_every_notice_as_due():
    """A horizon too large for a date (1e12 s) makes a notice a departure, never an
    OverflowError in the gate, the sidecar or the supervisor's pass."""
    from spotguard.wire.notice_policy import read

    assert read(_notice("maintenance", 600.0), T0, horizon_seconds=1e12).departs
