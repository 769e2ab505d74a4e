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
from spotguard.supervisor.status_render import COLUMNS, age, as_json, as_yaml, detail, table
from spotguard.supervisor.status_rows import job_row
from spotguard.wire import names

NOW = datetime(2026, 11, 25, 22, 0, 0, tzinfo=UTC)
RECORD = {"v": 1, "phase": "Running", "event": "SpotguardLeavingInPlace", "reason": "NoticeLeavingInPlace",
          "message": "notice r1 on n2: the replicas there leave in place", "decided_at": "2026-11-25T21:55:00Z",
          "reclaims_survived": 3, "capacity": "",
          "cost": {"spot_hours": 10.0, "on_demand_hours": 2.0, "cost": 16.0, "on_demand_equivalent": 36.0}}


def batch_job(name: str, annotations: dict, parallelism: int = 4, suspend: bool = False, conditions=()) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "train", "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": annotations},
            "spec": {"parallelism": parallelism, "completions": 4, "suspend": suspend,
                     "template": {"spec": {"containers": [{"name": "t"}]}}},
            "status": {"conditions": list(conditions)}}


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
    done = job_row(batch_job("done", elastic(RECORD), conditions=[{"type": "Complete", "status": "True"}]), job)
    assert done.phase == "Complete"


def test_a_pytorchjob_row():
    obj = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "pt", "namespace": "ml", "annotations": elastic(RECORD)},
           "spec": {"elasticPolicy": {"minReplicas": 2, "maxReplicas": 8},
                    "pytorchReplicaSpecs": {"Worker": {"replicas": 6, "template": {"spec": {}}}}}}
    row = job_row(obj, BY_KIND["PyTorchJob"])
    assert (row.kind, row.replicas, row.min_replicas, row.max_replicas) == ("PyTorchJob", 6, 2, 8)


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
