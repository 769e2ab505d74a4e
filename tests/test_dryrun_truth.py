"""The default and restart paths end to end, and what the dry-run says about them is true.

One real dry-run per path (real agents, sidecars, Guards, the supervisor over the local cluster;
the in-place path's is the bundled `preempted-twice`, which the bundled-scenario matrix leaves to
this module), checked for what the job did (in place: the survivor never restarts and the
returning node joins from a live peer; restart: every relaunch resumes the step the ranks agreed
and saved)
and for what the output says (issue 37, items 1-8: the plot's world-size series follows the
world the ranks formed, step numbers are the Guard's, the checkpoint folders', the restart
path's rows name relaunched processes and real worlds). Each run is one test: a run costs a
CI worker ~35-85 s, so every check of a path reads the same run; the checks are functions
named for what they prove, so a failure names the one that broke.

Also: a trainer that cannot start stops the run at once with its cause; a bad `--out` is one
clean line.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.trainer.report import render_text
from spotguard.trainer.scenario import load_scenario
from spotguard.trainer.timeline_plot import world_size_series
from tests.helpers import passing_dry_run
from tests.test_dryrun import SHORT_DEFAULT, assert_consistent_save, dry_run
from tests.test_scenarios_bundled import assert_passed_as_shipped

pytestmark = pytest.mark.slow

# Capacity returns late enough that the world-1 group has formed even on a loaded machine.
RESTART = SHORT_DEFAULT.replace("steps: 300", "steps: 800").replace("at: 8, kind: capacity", "at: 25, kind: capacity")


def notice_folders(run: Path) -> list[int]:
    folder = run / "claims" / "train-checkpoints" / "train"
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"step-(\d+)-notice", p.name)))


def finished_run(tmp_path: Path, scenario: str, *args: str) -> tuple[dict, str, Path]:
    code, report, output = dry_run(tmp_path, scenario, *args)
    assert report is not None, output[-3000:]
    assert code == 0 and report["ok"], (report["problems"], output[-3000:])
    return report, output, tmp_path / "run"


async def test_the_default_path_changes_membership_in_place_and_says_so_truly(tmp_path):
    """On the bundled `preempted-twice` as shipped (2 nodes; node-1 preempted, given back, preempted
    and given back again, 55 s of steps): the in-place path twice over, each departure and each
    return checked as the one of a run of its own was (a 2-node run of this test's own until this
    one took its place: the same path, once). The bundled-scenario matrix leaves this scenario to
    this test (tests/test_scenarios_bundled.py, `OWN_TESTS`): its report gets the matrix's checks
    too. The text checked is the one `spotguard dry-run` prints (render_text)."""
    shipped = load_scenario("preempted-twice")
    report = await passing_dry_run(shipped, tmp_path / "run")  # finished, every step, nothing left running
    assert_passed_as_shipped(shipped, report)
    output = render_text(report)
    survivor_kept_its_process_and_the_node_rejoined(report, output, shipped.steps)
    world_size_series_follows_the_membership_changes(report)
    steps_are_numbered_as_the_checkpoint_folder_is(report, output, tmp_path / "run")


def reclaims_and_returns(report: dict) -> list[tuple[dict, dict]]:
    """The timeline's rows as (reclaim, capacity) pairs: node-1 leaves, then comes back."""
    rows = report["timeline"]
    assert [row["kind"] for row in rows] == ["reclaim", "capacity"] * (len(rows) // 2) and rows, rows
    return list(zip(rows[::2], rows[1::2], strict=True))


def survivor_kept_its_process_and_the_node_rejoined(report: dict, output: str, steps: int) -> None:
    cycles = reclaims_and_returns(report)
    for reclaim, capacity in cycles:
        assert reclaim["ranks_agreed"] == [0, 1], reclaim
        assert reclaim["checkpoint_step"] == reclaim["agreed_step"], reclaim
        assert reclaim["margin_s"] > 0
        assert (reclaim["path"], reclaim["world"]) == ("in-place", "2 -> 1"), reclaim
        assert (capacity["path"], capacity["world"]) == ("in-place", "1 -> 2"), capacity
        assert "relaunched" not in reclaim and "relaunched" not in capacity
    assert [(c["from_world"], c["to_world"], c["path"]) for c in report["membership_changes"]] == \
        [(2, 1, "in-place"), (1, 2, "in-place")] * len(cycles)
    assert len(report["generations"]) == 1  # nobody was relaunched
    assert report["survivors"]["node-0"]["pid_kept"] is True, report["survivors"]
    assert report["survivors"]["node-1"]["joined"] is True, report["survivors"]
    assert report["steps_completed"] == steps and report["steps_lost"] == 0
    assert "in-place: world 2 -> 1" in output and "node-0: same process throughout" in output


def world_size_series_follows_the_membership_changes(report: dict) -> None:
    """Item 1: 2 -> 1 -> 2 (each time) as the ranks changed in place (it used to draw a flat 2)."""
    series = world_size_series(report)
    changes = report["membership_changes"]
    assert [w for _, w in series] == [2] + [1, 2] * len(reclaims_and_returns(report)) + [0], series
    assert [t for t, _ in series[1:-1]] == [c["t"] for c in changes], (series, changes)
    assert series[0][0] == report["generations"][0]["launched"]
    # every step rank 0 logged ran in the world the series draws at that time (the closing 0 is
    # drawn at the last step's time)
    for point in report["throughput"]:
        drawn = [w for t, w in series[:-1] if t <= point["t"]][-1]
        assert point["world_size"] == drawn, (point, series)


def steps_are_numbered_as_the_checkpoint_folder_is(report: dict, output: str, run: Path) -> None:
    """Item 8: agreed/durable step == the notice checkpoint's folder step (the Guard's numbering)."""
    reclaims = [reclaim for reclaim, _ in reclaims_and_returns(report)]
    assert notice_folders(run) == [r["checkpoint_step"] for r in reclaims] == [r["agreed_step"] for r in reclaims], \
        reclaims
    departures = report["membership_changes"][::2]
    for reclaim, departure in zip(reclaims, departures, strict=True):
        assert f"agreed {reclaim['agreed']:.2f}s at step {reclaim['agreed_step']}" in output
        assert f"durable {reclaim['durable']:.2f}s step {reclaim['checkpoint_step']}" in output
        assert departure["step"] == reclaim["agreed_step"], (departure, reclaim)


def test_the_restart_path_survives_a_reclaim_scales_back_and_says_so_truly(tmp_path):
    """torchrun per pod (c10d): the reclaim drains every rank, the Job controller relaunches the
    pods the supervisor scaled to (world 1); the node given back is scaled out to, and torchrun
    restarts the survivor's worker to grow (it drains: one consistent save, world 2)."""
    report, output, run = finished_run(tmp_path, RESTART, "--membership", "restart")
    every_relaunch_resumes_the_agreed_save(report, output, run)
    rows_series_and_processes_are_the_relaunched_ones(report, output, run)


def every_relaunch_resumes_the_agreed_save(report: dict, output: str, run: Path) -> None:
    reclaim, capacity = report["timeline"]
    assert reclaim["kind"] == "reclaim"
    assert_consistent_save(reclaim, world_size=2)
    assert reclaim["relaunch_world_size"] == 1
    assert reclaim["margin_s"] > 0
    assert capacity["kind"] == "capacity"
    assert_consistent_save(capacity, world_size=1)
    assert capacity["relaunch_world_size"] == 2
    assert report["steps_completed"] == 800 and report["steps_lost"] == 0
    assert (run / "timeline.png").stat().st_size > 10_000
    assert "resumed state == saved state" in output


def rows_series_and_processes_are_the_relaunched_ones(report: dict, output: str, run: Path) -> None:
    """Items 1 and 2: the relaunched ranks are not 'same process throughout'; every row's world
    is a real one; the series follows the generations."""
    series = world_size_series(report)
    generations = report["generations"]
    assert len(generations) >= 2, generations
    assert [t for t, w in series if w] == [g["launched"] for g in generations], (series, generations)
    assert [w for _, w in series if w] == [g["world_size"] for g in generations], (series, generations)
    assert series[-1][1] == 0
    assert "same process throughout" not in output, output[-3000:]
    assert re.search(r"node-0: relaunched \(\d processes in turn\)", output), output[-3000:]
    assert all(report["survivors"][n]["processes"] >= 2 for n in report["survivors"]), report["survivors"]
    for row in report["timeline"]:
        assert "?" not in row.get("world", ""), row
    reclaim = report["timeline"][0]
    saved = sorted(row["checkpoint_step"] for row in report["timeline"] if "checkpoint_step" in row)
    assert notice_folders(run) == saved and reclaim["checkpoint_step"] in saved, report["timeline"]
    assert reclaim["resumed_step"] == reclaim["checkpoint_step"], reclaim


def test_a_trainer_that_cannot_start_stops_the_run_with_its_cause(tmp_path):
    """Item 3: a bad trainer argument is a usage error (exit 2): the run stops at the first crash,
    prints the log's tail and path and the reason, and claims nothing about training."""
    code, report, output = dry_run(tmp_path, SHORT_DEFAULT, "--", "--bogus-arg", "1", timeout=150)
    assert code == 1, output[-3000:]
    assert report is not None and report["crash"] is not None, output[-3000:]
    crash = report["crash"]
    assert crash["exit_code"] == 2 and crash["crashes"] <= 2, crash  # the first crash of each index at most
    assert "unrecognized arguments: --bogus-arg 1" in output
    assert crash["log"] in output and Path(crash["log"]).exists()
    assert "gave up after repeated crashes" in output and "gave up after repeated crashes" in report["status"]
    assert "training finished first" not in output
    assert "not reached, the run ended first" in output
    assert not report["finished"]


@pytest.mark.parametrize("make, why", [
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "exists and is not a folder"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "sub", "cannot create"),
])
def test_an_unusable_out_is_one_clean_line(tmp_path, make, why):
    """Item 4: exit 2, one line naming the path, no traceback, nothing started."""
    out = make(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "spotguard", "dry-run", "--no-live", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert proc.stderr.strip() == f"spotguard dry-run: error: --out: {out} {why}" \
        or proc.stderr.strip().startswith(f"spotguard dry-run: error: --out: {why} {out}"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_the_bundled_two_reclaims_scenario_returns_to_three_in_time():
    """Item 6: its promise ("then back to 3") fits its timing: the capacity comes back with at
    least 10 s of training left at its step time."""
    s = load_scenario("two-reclaims")
    capacity = max(e.at for e in s.events if e.kind == "capacity")
    assert s.steps * s.step_seconds - capacity >= 10.0, (s.steps, s.step_seconds, capacity)
    assert json.dumps([e.kind for e in s.events]).count("capacity") == 2


def test_only_crashes_before_training_count_toward_giving_up(tmp_path):
    from spotguard.trainer.cluster_log import PodLife
    from spotguard.trainer.crashes import CRASH_LIMIT, give_up

    def pod(name, code, lost=False):
        return PodLife(name=name, uid=name, index=0, created=0.0, finished=1.0, exit_code=code, node_lost=lost)

    # peers of a killed rank crash after training: the job's recovery, not a reason to stop
    peers = [pod(f"trained-{i}", 1) for i in range(CRASH_LIMIT + 2)]
    assert give_up(peers, lambda name: name.startswith("trained"), tmp_path, job_trained=False) is None
    drained_lost_or_killed = [pod("a", 83), pod("b", 0), pod("c", 1, lost=True), pod("d", 137), pod("e", 143)]
    assert give_up(drained_lost_or_killed * CRASH_LIMIT, lambda name: False, tmp_path, job_trained=False) is None
    never_started = [pod(f"new-{i}", 1) for i in range(CRASH_LIMIT)]
    assert give_up(never_started[:-1], lambda name: False, tmp_path, job_trained=False) is None
    crash = give_up(never_started, lambda name: False, tmp_path, job_trained=False)
    assert crash is not None and crash.crashes == CRASH_LIMIT and crash.pod == f"new-{CRASH_LIMIT - 1}"
    # once the job trained, crashes before a relaunched trainer started are part of the recovery
    assert give_up(never_started, lambda name: False, tmp_path, job_trained=True) is None
    usage = give_up([pod("bad-args", 2)], lambda name: False, tmp_path, job_trained=True)
    assert usage is not None and "a usage error" in usage.status
