"""The deadline watchdog under the framework integrations (issue 36, item 5), across real ranks (the
reference scripts of the Trainer and Lightning, DDP on gloo, 2 ranks).

With `snapshot_every=4` (`SpotguardCallback.attach(trainer, ..., snapshot_every=4)`,
`lightning.SpotguardCallback(..., snapshot_every=4)`) the framework's own checkpoint is captured
into memory every 4 steps at the step boundary. A notice (SIGTERM to rank 1) while both ranks are in
an evaluation pass (the Trainer's `eval_steps`, Lightning's `val_check_interval`) that outlasts the
grace: the watchdogs persist the snapshot of step 4 (the evaluation runs after step 6) in the
framework's format, committed under the framework's name (`checkpoint-4`; Lightning's `last.ckpt`),
and every rank exits 83 before the deadline; the framework's own resume
(`train(resume_from_checkpoint=last_checkpoint(trainer))`, `fit(ckpt_path="last")`) continues from
it with the optimizer state equal bit for bit and the data position continuing. Without
`snapshot_every` the same run leaves with 84 (nothing held to persist).
The resume on one rank keeps the global batch (the per-device batch doubles): the Trainer's and
Lightning's resume at a new world size with the global batch kept (tests/test_integrations_multirank.py
keeps each rank's batch).
"""
from __future__ import annotations

import json
import signal
import time

import pytest

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.trainer.framework_refs import expected_ids
from tests.framework_runs import (MODULES, TOTAL, args, assert_same_optimizer_state, complete_run, ids_by_step,
                                  optimizer_state, resumed)
from tests.test_deadline_watchdog import wait_for_files
from tests.test_integrations_multirank import newest_step
from tests.workers.launch import Run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # two runs; minutes only on a loaded machine

GRACE = 10.0
EVERY, EVAL_AT = 4, 6  # snapshots at steps 4, 8, ...; the evaluation pass after step 6
SLOW_EVAL = ("--step-sleep", "0.05", "--eval-every", str(EVAL_AT), "--eval-seconds", "60")


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_notice_during_evaluation_persists_the_held_snapshot_and_the_framework_resumes_from_it(framework, tmp_path):
    ckpt, first, last = tmp_path / "ckpt", tmp_path / "first", tmp_path / "last"
    env = {r: {"SPOTGUARD_GRACE_SECONDS": str(GRACE), "SPOTGUARD_TERMINATION_LOG": str(tmp_path / f"term-{r}")}
           for r in range(2)}
    with Run(2, args(ckpt, first, *SLOW_EVAL, "--integration-snapshot-every", str(EVERY)), first / "logs",
             rank_env=env, module=MODULES[framework]) as run:
        wait_for_files([first / "evaluating-0", first / "evaluating-1"], run)
        signalled = time.monotonic()
        run.procs[1].send_signal(signal.SIGTERM)
        codes = run.wait(GRACE + 60)
        took = time.monotonic() - signalled
        tail = run.tail()
    assert codes == [83, 83], tail
    assert took < GRACE, f"the ranks left {took:.1f}s after the signal, past the {GRACE}s deadline\n{tail}"
    assert newest_step(framework, ckpt) == EVERY  # what the framework's own resume picks
    info = CheckpointStore(ckpt).resolve(verify=True)
    assert (info.step, info.metadata["reason"], info.metadata["snapshot"]) == (EVERY, "notice", True)
    for r in range(2):
        message = json.loads((tmp_path / f"term-{r}").read_text())
        assert (message["checkpoint"], message["saved_by"], message["saved_step"], message["steps_lost"]) == (
            "durable", "watchdog", EVERY, EVAL_AT - EVERY), message
        assert 0 < message["margin_seconds"] < GRACE, message

    complete_run(framework, 1, ckpt, last)
    assert resumed(last) == {"start": EVERY, "optimizer_steps": [EVERY]}
    assert_same_optimizer_state(optimizer_state(first, f"step-{EVERY}"), optimizer_state(last, "resumed"))
    got = ids_by_step(last, 1)
    assert sorted(got) == list(range(EVERY + 1, TOTAL + 1))
    assert all(got[s] == expected_ids(s) for s in got), "the data position did not continue"
