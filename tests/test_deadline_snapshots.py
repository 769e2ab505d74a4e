"""Snapshots that are fresh enough (issue 36, item 4) across real ranks (gloo, 2 DDP ranks): a
notice makes every rank snapshot on a denser grid for the steps it has left, so when a step then
becomes long the deadline watchdog persists a step trained after the notice, not the periodic
snapshot from before it.

Each notice is rank 1's SIGTERM after a given step with a 12 s grace, held by a 4 s horizon
(`SPOTGUARD_HORIZON_SECONDS`: the ranks train on, as under a notice announced ahead), with
`snapshot_every=25`. Once both ranks have snapshotted a step of the grid the test makes one rank's
next step long (a file it waits on, as an evaluation pass): the other sits in DDP's all_reduce.
Every wait is on a condition; the deadline is the product's (exit 83, the termination message's
margin). Two ways to hold, one chain: the second run resumes from the first's checkpoint (its
notice comes after a periodic snapshot of its own), and one resume to the end checks both
checkpoints against an uninterrupted run.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.test_deadline_watchdog import LONG_WAIT, checkpoints, messages, term_env, uninterrupted_state
from tests.workers.launch import Run, assert_same_state, load_state, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TOTAL = 300  # past both notices' saves even if a loaded machine trains the whole 4 s horizon
EVERY = 25
FIRST_NOTICE = 60
NEXT_NOTICE_AFTER = 40  # the second notice, this many steps after the first save: a periodic snapshot between
# The notice's deadline: the watchdog acts ~5 s before it (deadline_policy.act_at), so each run
# waits ~7 s for it after the notice; the ranks reach the denser grid and the long step ~1 s after
# the notice (19 steps). 20 s (before) added 8 s of waiting to each of the two runs.
GRACE = 12.0
HELD_BEFORE_ITS_STEP = ["--hold-rank", "1"]  # rank 1 before its next step: both completed the same steps
# rank 0 after its step's all_reduce, before its boundary: rank 1 must not snapshot that step alone
HELD_BEFORE_ITS_BOUNDARY = ["--hold-rank", "0", "--hold-after-step"]


def snapshot_steps(out: Path, rank: int) -> list[int]:
    path = out / f"snapshots-{rank}"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def wait_for_grid_snapshots(out: Path, run: Run, notice: int) -> list[int]:
    """Waits until every rank snapshotted a step after the notice that is not a periodic one; the
    newest such step of each rank."""
    end = time.monotonic() + LONG_WAIT
    while True:
        dense = [[s for s in snapshot_steps(out, r) if s > notice and s % EVERY] for r in range(2)]
        if all(dense):
            return [steps[-1] for steps in dense]
        if any(p.poll() is not None for p in run.procs):
            raise AssertionError(f"a rank exited before any denser snapshot (snapshots: {dense}):\n{run.tail()}")
        if time.monotonic() > end:
            raise AssertionError(f"no denser snapshots on every rank (snapshots: {dense}):\n{run.tail()}")
        time.sleep(0.02)


def a_notice_makes_snapshots_denser_so_the_watchdog_persists_a_step_after_it(tmp_path, name: str, held: list[str],
                                                                            notice: int) -> int:
    """One run to its notice after step `notice` and the long step; returns the step the watchdog persisted."""
    ckpt, out = tmp_path / "ckpt", tmp_path / name
    before = checkpoints(ckpt) if ckpt.exists() else []
    args = ["--mode", "ddp", "--ckpt", str(ckpt), "--out", str(out), "--steps", "1000", "--snapshot-every",
            str(EVERY), "--step-sleep", "0.05", "--signal-at", str(notice), "--signal-rank", "1", *held,
            "--hold-when", "hold-now", "--log-snapshots", "--grace", str(GRACE), "--no-compare"]
    env = term_env(tmp_path, name, {"SPOTGUARD_HORIZON_SECONDS": "4"})
    with Run(2, args, out / "logs", rank_env=env) as run:
        newest = wait_for_grid_snapshots(out, run, notice)
        (out / "hold-now").touch()
        codes = run.wait(GRACE + 60)
    assert codes == [83, 83], run.tail()
    [saved] = {m["saved_step"] for m in messages(tmp_path, name)}
    assert saved > notice and saved >= max(newest), (saved, newest)   # not the periodic one before the notice
    assert all(saved in snapshot_steps(out, r) for r in range(2))
    assert checkpoints(ckpt) == sorted([*before, f"step-{saved:09d}-notice"])
    for m in messages(tmp_path, name):
        assert (m["checkpoint"], m["saved_by"], m["steps_lost"]) == ("durable", "watchdog", m["step"] - saved), m
        assert 0 < m["margin_seconds"] < GRACE, m   # gone before the deadline
    return saved


def test_a_notice_makes_snapshots_denser_so_the_watchdog_persists_a_step_after_it(tmp_path_factory, tmp_path):
    first = a_notice_makes_snapshots_denser_so_the_watchdog_persists_a_step_after_it(
        tmp_path, "held-before-its-step", HELD_BEFORE_ITS_STEP, FIRST_NOTICE)
    second = a_notice_makes_snapshots_denser_so_the_watchdog_persists_a_step_after_it(
        tmp_path, "held-before-its-boundary", HELD_BEFORE_ITS_BOUNDARY, first + NEXT_NOTICE_AFTER)
    assert second < TOTAL - 1, (first, second)
    reference = uninterrupted_state(tmp_path_factory.mktemp("reference"), TOTAL)
    resumed = tmp_path / "resumed"
    codes, tail = run_ranks(2, ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(resumed), "--steps",
                                str(TOTAL)], resumed / "logs", timeout=LONG_WAIT)
    assert codes == [0, 0], tail
    assert_same_state(load_state(resumed / "state-final.pt"), reference)
