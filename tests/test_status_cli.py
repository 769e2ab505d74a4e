"""`spotguard status` without a cluster: the row of each job from what the supervisor wrote
(supervisor/status_rows.py), the table, JSON/YAML and the detail view (status_render.py), and bad
input (no kubeconfig, an unreachable API, an unknown output) exiting non-zero with a clear error.
The real API server runs are tests/test_k8s_status.py."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import yaml

from spotguard.supervisor.jobs import BY_KIND
from spotguard.supervisor.status_cli import warn_problems
from spotguard.supervisor.status_render import COLUMNS, age, as_json, as_yaml, detail, table
from spotguard.supervisor.status_rows import job_row
from spotguard.wire import names

NOW = datetime(2026, 11, 25, 22, 0, 0, tzinfo=UTC)
RECORD = {"v": 1, "phase": "Running", "event": "SpotguardLeavingInPlace", "reason": "NoticeLeavingInPlace",
          "message": "notice r1 on n2: the replicas there leave in place", "decided_at": "2026-11-25T21:55:00Z",
          "reclaims_survived": 3, "capacity": "",
          "cost": {"spot_hours": 10.0, "on_demand_hours": 2.0, "cost": 16.0, "on_demand_equivalent": 36.0}}


def batch_job(name: str, annotations: dict, parallelism: int = 4, suspend: bool = False, conditions=(),
              ready: int | None = None) -> dict:
    """A Job as the API returns it; `ready` its controller's count of Ready pods (default: all)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "train", "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": annotations},
            "spec": {"parallelism": parallelism, "completions": 4, "suspend": suspend,
                     "template": {"spec": {"containers": [{"name": "t"}]}}},
            "status": {"conditions": list(conditions), "active": 0 if suspend else parallelism,
                       "ready": (0 if suspend else parallelism) if ready is None else ready}}


def elastic(record: dict | None, **extra: str) -> dict:
    out = {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "2", **extra}
    if record is not None:
        out[names.ANN_STATUS] = json.dumps(record)
    return out


def test_a_row_reads_policy_record_cost_and_steps_lost():
    row = job_row(batch_job("llm", elastic(RECORD, **{names.ANN_STEPS_LOST: "7", names.ANN_IN_PLACE: "true"})),
                  BY_KIND["Job"])
    assert (row.policy, row.phase, row.replicas, row.min_replicas, row.max_replicas) == \
        ("elastic/in-place", "Running", 4, 2, 4)
    assert (row.spot_replicas, row.on_demand_replicas, row.reclaims_survived, row.steps_lost) == (4, 0, 3, 7)
    assert row.node_hours == 12.0 and abs(row.savings_ratio - (1 - 16 / 36)) < 1e-9
    assert (row.last_decision, row.decided_at) == ("SpotguardLeavingInPlace", NOW - timedelta(minutes=5))


def test_rows_for_fallback_suspension_invalid_unreadable_and_finished_jobs():
    job = BY_KIND["Job"]
    fallen = job_row(batch_job("od", elastic({**RECORD, "capacity": "on-demand"},
                                             **{names.ANN_FALLBACK: "on-demand"})), job)
    assert (fallen.policy, fallen.spot_replicas, fallen.on_demand_replicas) == ("elastic+fallback", 0, 4)
    mixed = job_row(batch_job("mixed", elastic({**RECORD, "split": {"spot": 3, "on-demand": 1}})), job)
    assert (mixed.spot_replicas, mixed.on_demand_replicas) == (3, 1)  # the backfill's split of the pods
    odd = job_row(batch_job("odd", elastic({**RECORD, "split": {"spot": "3"}})), job)
    assert (odd.spot_replicas, odd.on_demand_replicas) == (4, 0)  # an unreadable split: by capacity
    waiting = job_row(batch_job("w", elastic({**RECORD, "phase": "Suspended"}), suspend=True), job)
    assert (waiting.phase, waiting.replicas) == ("Suspended", 0)
    bad = job_row(batch_job("bad", {names.ANN_POLICY: "sometimes"}), job)
    assert bad.policy == "invalid" and bad.min_replicas is None and names.ANN_POLICY in bad.problem
    broken = job_row(batch_job("broken", {names.ANN_STATUS: "{nope"}), job)
    assert broken.phase == "Unknown" and "not JSON" in broken.problem
    fresh = job_row(batch_job("fresh", {}), job)  # never acted on: no record yet, nothing invented
    assert (fresh.policy, fresh.phase, fresh.steps_lost, fresh.node_hours, fresh.last_decision) == \
        ("fixed", "Running", None, None, "")
    assert (fresh.replicas, fresh.spot_replicas, fresh.on_demand_replicas) == (4, None, None)
    done = job_row(batch_job("done", elastic(RECORD), conditions=[{"type": "Complete", "status": "True"}]), job)
    assert done.phase == "Complete"


def test_a_pytorchjob_row():
    obj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "pt", "namespace": "ml", "annotations": elastic(RECORD)},
           "spec": {"elasticPolicy": {"minReplicas": 2, "maxReplicas": 8},
                    "pytorchReplicaSpecs": {"Worker": {"replicas": 6, "template": {"spec": {}}}}},
           "status": {"replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 5}}}}
    row = job_row(obj, BY_KIND["PyTorchJob"])
    assert (row.kind, row.replicas, row.min_replicas, row.max_replicas) == ("PyTorchJob", 5, 2, 8)
    assert row.phase == "Running"
    del obj["status"]  # no operator wrote a status: how many run is not known
    row = job_row(obj, BY_KIND["PyTorchJob"])
    assert (row.replicas, row.phase, row.spot_replicas) == (None, "Running", None)


def test_without_a_supervisor_pending_pods_are_starting_and_nothing_is_counted():
    """No record (no supervisor ran), 4 pods Pending: the job asks for 4 and none runs."""
    job = BY_KIND["Job"]
    pending = job_row(batch_job("pending", elastic(None), ready=0), job)
    assert (pending.phase, pending.replicas, pending.spot_replicas, pending.on_demand_replicas) == \
        ("Starting", 0, None, None)
    assert table([pending], NOW).splitlines()[1].split()[4:7] == ["Starting", "0/2/4", "-"]
    half = job_row(batch_job("half", elastic(None), ready=2), job)
    assert (half.phase, half.replicas, half.spot_replicas) == ("Running", 2, None)
    held = job_row(batch_job("held", {}, suspend=True), job)  # suspended by its owner, no record
    assert (held.phase, held.replicas) == ("Suspended", 0)
    decided = job_row(batch_job("decided", elastic(RECORD), ready=3), job)  # decided: counted on its capacity
    assert (decided.replicas, decided.spot_replicas, decided.on_demand_replicas) == (3, 3, 0)


BACKFILL = {**RECORD, "event": "SpotguardLeavingInPlace", "decided_at": "2026-11-25T21:50:00Z",
            "generation": 4, "members": ["spot-1", "od-0", "spot-2"], "start_generation": 1,
            "split": {"spot": 2, "on-demand": 2}, "backfill_event": "SpotguardWarmStandby",
            "backfill": "1 on-demand replica(s): warm standby for a leaving member (no spot slot free)",
            "backfill_at": "2026-11-25T21:59:30Z", "below_max_since": None,
            "spot_idle_since": "2026-11-25T21:59:00Z"}


def backfill_job(record: dict | None, ready: int = 4) -> dict:
    """An in-place, start-at-min backfill Job with the spare: max 3, parallelism 4."""
    annotations = elastic(record, **{names.ANN_IN_PLACE: "true", names.ANN_START_AT_MIN: "true",
                                     names.ANN_MAX_REPLICAS: "3", names.ANN_FALLBACK: "on-demand"})
    return batch_job("bf", annotations, ready=ready)


def test_a_backfill_job_shows_its_group_placement_and_clocks():
    job = BY_KIND["Job"]
    # Before its first group: nothing trains, whatever the Job's parallelism (the spare included).
    before = job_row(backfill_job({"v": 1, "split": {"spot": 3, "on-demand": 0}, "backfill_event":
                                   "SpotguardPlacedOnSpot", "backfill": "3 spot replica(s) for free spot slots",
                                   "backfill_at": "2026-11-25T21:58:00Z"}, ready=0), job)
    assert (before.phase, before.replicas, before.max_replicas, before.generation) == ("Starting", 0, 3, None)
    assert (before.last_decision, before.decided_at) == ("SpotguardPlacedOnSpot", NOW - timedelta(minutes=2))
    row = job_row(backfill_job(BACKFILL), job)
    assert (row.phase, row.replicas, row.generation, row.members) == ("Running", 3, 4, ("spot-1", "od-0", "spot-2"))
    # the placement came after the policy's last decision: it is the last decision shown
    assert (row.last_decision, row.last_reason, row.decided_at) == \
        ("SpotguardWarmStandby", "Backfill", NOW - timedelta(seconds=30))
    assert row.last_message.startswith("1 on-demand replica(s): warm standby")
    assert (row.decision, row.decision_at) == ("SpotguardLeavingInPlace", NOW - timedelta(minutes=10))
    assert table([row], NOW).splitlines()[1].split()[4:7] == ["Running", "3/2/3", "2/2"]
    assert table([row], NOW).splitlines()[1].split()[-2:] == ["WarmStandby", "30s"]
    item = json.loads(as_json([row]))["items"][0]
    assert item["backfill_event"] == "SpotguardWarmStandby" and item["backfill_at"].startswith("2026-11-25T21:59:30")
    assert item["below_max_since"] is None and item["spot_idle_since"].startswith("2026-11-25T21:59:00")
    assert item["members"] == ["spot-1", "od-0", "spot-2"] and item["generation"] == 4
    text = detail(row, [], NOW)
    assert "Membership:        generation 4: spot-1, od-0, spot-2\n" in text
    assert "Last placement:    SpotguardWarmStandby 30s ago: 1 on-demand replica(s): warm standby" in text
    assert "Below max since:   -\n" in text and "Spot free since:   60s ago\n" in text
    older = job_row(backfill_job({**BACKFILL, "decided_at": "2026-11-25T21:59:50Z"}), job)
    assert (older.last_decision, older.last_reason) == ("SpotguardLeavingInPlace", "NoticeLeavingInPlace")


def test_the_table_says_why_a_policy_is_invalid_on_stderr(capsys):
    rows = [job_row(batch_job("bad", {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "two"}), BY_KIND["Job"]),
            job_row(batch_job("ok", elastic(None)), BY_KIND["Job"])]
    warn_problems(rows)
    err = capsys.readouterr().err.splitlines()
    assert err == ["spotguard status: warning: Job train/bad: invalid policy annotation spotguard.io/min-replicas: "
                   "expected a whole number >= 1, got 'two'"]


def test_a_job_whose_horizon_the_supervisor_refuses_shows_invalid(capsys):
    """`status` reads the policy as the reconciler does, the pod template's horizon included: a
    job the supervisor leaves untouched for it is not shown as a running policy."""
    bad = batch_job("far", elastic(None))
    bad["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "SPOTGUARD_HORIZON_SECONDS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "h"}}}]
    row = job_row(bad, BY_KIND["Job"])
    warn_problems([row])
    err = capsys.readouterr().err.splitlines()
    assert row.policy == "invalid" and len(err) == 1, (row, err)
    assert err[0].startswith("spotguard status: warning: Job train/far: invalid policy pod template entry "
                             "spec.containers[].env[SPOTGUARD_HORIZON_SECONDS]: set it as a value")


def test_table_json_and_yaml():
    rows = [job_row(batch_job("llm", elastic(RECORD, **{names.ANN_STEPS_LOST: "7"})), BY_KIND["Job"]),
            job_row(batch_job("fresh", {}), BY_KIND["Job"])]
    lines = table(rows, NOW).splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert lines[1].split() == ["train", "Job", "llm", "elastic", "Running", "4/2/4", "4/0", "3", "7", "12.00",
                                "56%", "LeavingInPlace", "5m"]
    assert lines[2].split()[-6:] == ["0", "-", "-", "-", "-", "-"]
    assert table([], NOW) == "No managed jobs found.\n"
    for text, load in ((as_json(rows), json.loads), (as_yaml(rows), yaml.safe_load)):
        items = load(text)["items"]
        assert [i["name"] for i in items] == ["llm", "fresh"]
        assert items[0]["decided_at"].startswith("2026-11-25T21:55:00") and items[0]["node_hours"] == 12.0


def test_age_like_kubectl():
    assert [age(NOW - timedelta(seconds=s), NOW) for s in (5, 119, 120, 7200, 3 * 86400)] == \
        ["5s", "119s", "2m", "2h", "3d"]
    assert age(None, NOW) == "-"


def test_detail_shows_the_events_oldest_first():
    row = job_row(batch_job("llm", elastic(RECORD)), BY_KIND["Job"])
    events = [{"type": "Normal", "reason": "SpotguardResumed", "message": "capacity\nreturned",
               "lastTimestamp": "2026-11-25T21:59:00Z", "reportingComponent": "spotguard-supervisor"},
              {"type": "Warning", "reason": "SpotguardSuspended", "message": "below min",
               "lastTimestamp": "2026-11-25T21:50:00Z", "source": {"component": "spotguard-supervisor"}}]
    text = detail(row, events, NOW)
    assert "Replicas:" in text and "4 (min 2, max 4)" in text and "Savings:" in text
    tail = text.split("Events:\n")[1].splitlines()
    assert tail[0].split() == ["Type", "Reason", "Age", "From", "Message"]
    assert tail[1].split()[:3] == ["Warning", "SpotguardSuspended", "10m"]
    assert tail[2].endswith("capacity returned")
    assert detail(row, [], NOW).endswith("Events:\n  <none>\n")


def run_status(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotguard", "status", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_no_kubeconfig_exits_2_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    result = run_status(env=env)
    assert result.returncode == 2 and "--kubeconfig" in result.stderr and "no kubeconfig" in result.stderr
    missing = run_status("--kubeconfig", str(tmp_path / "nope"), env=env)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_an_unreachable_api_exits_1_naming_the_server():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    result = run_status("--kube-host", url, "--request-timeout", "5")
    assert result.returncode == 1 and url in result.stderr and "cannot reach it" in result.stderr
    assert result.stdout == ""


def test_an_unknown_output_exits_2():
    result = run_status("-o", "wide", "--kube-host", "http://127.0.0.1:1")
    assert result.returncode == 2 and "--output" in result.stderr
