"""The bundled scenario `long-step-short-notice` as a real dry-run (issue 36): a reclaim whose
deadline falls inside a long step (an evaluation pass) is answered by the Guard's deadline
watchdog. No step boundary comes before the deadline, so the ranks never agree on a step; the
held in-memory snapshot is persisted, every rank leaves with 83 before the deadline, and the job
resumes from that step with the state it saved. The report says so from what the ranks reported
(their termination messages): the watchdog saved, the step, the steps the snapshot cost and the
margin to the deadline. Without the watchdog the ranks are still in the long step at the
deadline, the node dies with its rank training, and the run fails.

One dry-run (about a minute of a CI worker); the bundled-scenario matrix leaves this scenario to
this test (tests/test_scenarios_bundled.py, `OWN_TESTS`).
"""
from __future__ import annotations

import pytest

from spotguard.trainer.report import render_text
from spotguard.trainer.scenario import load_scenario
from spotguard.wire.names import EXIT_PREEMPTED
from tests.helpers import passing_dry_run

pytestmark = pytest.mark.slow

SNAPSHOT_EVERY = 5  # the dry-run's trainer snapshots every 5 steps (trainer/dryrun.py)


@pytest.mark.timeout(360)
async def test_a_notice_inside_a_long_step_is_answered_by_the_deadline_watchdog(tmp_path):
    scenario = load_scenario("long-step-short-notice")
    long_step, long_seconds = scenario.long_step
    report = await passing_dry_run(scenario, tmp_path / "run")
    (row,) = report["timeline"]
    # the notice and its deadline fell inside the long step: rank 0 had completed the step before it
    # and completed none after it until its process left
    first = [p for p in report["throughput"] if p["generation"] == 0]
    last = max(first, key=lambda p: p["t"])
    assert last["step"] == long_step, (last, row)  # `step` counts completed steps: long_step of them
    assert last["t"] < row["served"] and row["deadline"] < last["t"] + long_seconds, (last, row)
    # no agreement at a boundary: the watchdog persisted the held snapshot, every rank left with 83
    assert "agreed" not in row and "agreed_step" not in row, row
    held = (long_step - 1) // SNAPSHOT_EVERY * SNAPSHOT_EVERY
    assert (row["saved_by"], row["checkpoint_step"], row["snapshot_steps"]) == \
        ("watchdog", held, long_step - 1 - held), row
    assert row["exit_codes"] == [EXIT_PREEMPTED], row
    assert report["generations"][0]["exit_codes"] == {"node-0": EXIT_PREEMPTED, "node-1": EXIT_PREEMPTED}, \
        report["generations"]
    assert 0 < row["left_margin_s"] < scenario.events[0].lead, row
    # every rank had written its last word, right before its exit, by then (and node-1's rank process
    # was gone when its node died at the deadline: the run has no problem)
    assert row["drained"] < row["deadline"], row
    # the job resumed bit-exactly from that step; only the steps trained after the snapshot are lost
    assert (row["path"], row["resumed_step"]) == ("relaunch", held), row
    assert row["saved_digest"] and row["saved_digest"] == row["resumed_digest"], row
    assert report["steps_lost"] == row["steps_lost"] == long_step - 1 - held, report["relaunches"]
    assert f"saved by watchdog at step {held} ({long_step - 1 - held} steps trained after it), left " \
        f"{row['left_margin_s']:.2f}s before the deadline" in render_text(report)
