"""The local dry-run end to end: real agents, sidecars, Guards and torchrun, simulated reclaims.

Each test runs `spotguard dry-run` as a user would and asserts on its JSON report.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.trainer.dryrun import STACK_DUMP
from spotguard.trainer.reaper import DUMP_WAIT

pytestmark = pytest.mark.slow


def dry_run(tmp_path: Path, scenario_text: str | None = None, *args: str,
            timeout: float = 300) -> tuple[int, dict | None, str]:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "spotguard", "dry-run", "--no-live", "--out", str(out), "--time-limit", "240"]
    if scenario_text is not None:
        path = tmp_path / "scenario.yaml"
        path.write_text(scenario_text)
        cmd += ["--scenario", str(path)]
    cmd += args  # last: `-- TRAINER ARGS` takes the rest
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the dry-run stops everything it started
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"dry-run did not finish in {timeout}s:\n{output[-4000:]}")
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return proc.returncode, report, output


SHORT_DEFAULT = """\
name: short-default
cloud: aws
workers: 2
policy: elastic
min_workers: 1
steps: 300
step_seconds: 0.03
events:
  - {at: 2, kind: reclaim, node: node-1, lead: 15}
  - {at: 8, kind: capacity, node: node-1}
"""


def assert_consistent_save(entry: dict, world_size: int) -> None:
    assert entry["ranks_agreed"] == list(range(world_size)), entry
    assert entry["checkpoint_step"] == entry["agreed_step"], entry
    assert entry["resumed_step"] == entry["checkpoint_step"], entry
    assert entry["steps_lost"] == 0, entry
    assert entry["saved_digest"] and entry["saved_digest"] == entry["resumed_digest"], entry


MISSED_DEADLINE = """\
name: missed-deadline
cloud: aws
workers: 2
policy: elastic
min_workers: 1
membership: restart
steps: 120
step_seconds: 0.05
events:
  - {at: 2, kind: reclaim, node: node-1, lead: 0}
"""


def test_a_rank_still_training_at_its_deadline_fails_the_run_and_no_worker_of_it_trains_on(tmp_path):
    """No Guard (`-- --no-guard`): nothing drains node-1's rank before its node's deadline. The
    node dies then: every process of its pod is killed (torchrun's worker too, in a session of its
    own), so no step of node-1 is logged past the deadline, and the run fails (exit 1) naming the
    missed deadline. The notice has no lead: the node dies at the dry-run's next tick, before the
    supervisor can relaunch node-0 for the new membership (with 1 s and 4 s, a loaded machine let
    the relaunch come first; node-0's rank leaving failed node-1's collective: a crash before the
    deadline, not a missed one). 120 steps last 6 s at least, past the deadline at 2 s."""
    code, report, output = dry_run(tmp_path, MISSED_DEADLINE, "--", "--no-guard", timeout=420)
    assert report is not None, output[-3000:]
    assert code == 1 and not report["ok"], (report["problems"], output[-3000:])
    missed = [p for p in report["problems"] if p.startswith("node-1 reached its deadline with its rank still training")]
    assert missed, report["problems"]
    # Where it was: the rank wrote its threads' stacks to its pod's log before the kill, and the problem says so.
    pod = re.search(r"\(pod (\S+), step", missed[0]).group(1)
    assert missed[0].endswith(f"its threads' stacks then: logs/{pod}.log"), missed[0]
    dump = (tmp_path / "run" / "logs" / f"{pod}.log").read_text()
    assert STACK_DUMP.search(dump) and 'trainer/train.py", line' in dump, dump[-2000:]
    events = [json.loads(line) for path in (tmp_path / "run" / "events").glob("*.jsonl")
              for line in path.read_text().splitlines() if line.strip()]
    started = min(e["t"] for e in events if e["event"] == "start")
    deadline = started + report["timeline"][0]["deadline"]
    late = [e for e in events if e.get("node") == "node-1" and e["event"] == "step"
            and e["t"] > deadline + 1.0 + DUMP_WAIT]  # the node's death waits for the dump
    assert late == [], f"node-1 trained on past its deadline: {late[:3]}"
    assert "reached its deadline" in output


def test_malformed_scenario_names_the_line_and_starts_nothing(tmp_path):
    bad = ("name: bad\nworkers: 2\nevents:\n"
           "  - {at: 1, kind: reclaim, node: node-0}\n  - {at: 2, kind: meteor, node: node-1}\n")
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "spotguard", "dry-run", "--no-live", "--scenario", str(path),
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{path}:5" in proc.stderr and "kind" in proc.stderr and "meteor" in proc.stderr
    assert not out.exists()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_framework_integration_dry_run_takes_the_restart_path(tmp_path, framework):
    """`--framework hf|lightning`: the reference script with its integration; a reclaim -> every
    rank saves the same step through the framework, exit 83, relaunch on the survivor resumes it."""
    scenario = SHORT_DEFAULT.replace("name: short-default", f"name: short-{framework}") \
        .replace("steps: 300", "steps: 200").replace("  - {at: 8, kind: capacity, node: node-1}\n", "")
    code, report, output = dry_run(tmp_path, scenario, "--framework", framework, timeout=420)
    assert report is not None, output[-3000:]
    assert code == 0 and report["ok"], (report["problems"], output[-3000:])
    (reclaim,) = report["timeline"]
    assert_consistent_save(reclaim, world_size=2)
    assert reclaim["relaunch_world_size"] == 1


def test_the_accelerate_dry_run_changes_membership_in_place(tmp_path):
    """`--framework accelerate` (the reference script with `AccelerateGuard(in_place=True)`): a
    reclaim -> both ranks agree on one step and save it, the reclaimed rank leaves, the survivor
    trains on at world 1 in the same process, nothing lost. (The grow in place, the sampler and
    the joiner's state: tests/test_data_ledger_integrations_in_place.py.)"""
    scenario = SHORT_DEFAULT.replace("name: short-default", "name: short-accelerate") \
        .replace("steps: 300", "steps: 200").replace("  - {at: 8, kind: capacity, node: node-1}\n", "")
    code, report, output = dry_run(tmp_path, scenario, "--framework", "accelerate", timeout=420)
    assert report is not None, output[-3000:]
    assert code == 0 and report["ok"], (report["problems"], output[-3000:])
    (reclaim,) = report["timeline"]
    assert reclaim["ranks_agreed"] == [0, 1] and reclaim["checkpoint_step"] == reclaim["agreed_step"], reclaim
    assert (reclaim["path"], reclaim["world"]) == ("in-place", "2 -> 1"), reclaim
    assert len(report["generations"]) == 1, report["generations"]  # nobody was relaunched
    assert report["survivors"]["node-0"]["pid_kept"] is True, report["survivors"]
    assert report["steps_completed"] == 200 and report["steps_lost"] == 0
