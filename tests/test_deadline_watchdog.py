"""The deadline watchdog across real ranks (gloo, 2 DDP ranks, issue 36): a notice whose deadline
comes before the next step boundary still ends with the newest snapshot durable and every rank
gone with 83 before the deadline; a notice with nothing new to save leaves at once; an async
save in flight that cannot finish, or a persist that fails, ends with 84 and the previous
checkpoint the newest.

The long step waits on a file the test never writes (an evaluation pass, a data stall): only
rank 1 holds, so rank 0 sits in DDP's gradient all_reduce (a C call) meanwhile. Deadlines are
the product's: the termination message's margin, and the exit seen by the test before the
notice's deadline.
"""
from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from spotguard.wire.notice import Notice, now_utc
from tests.workers.launch import Run, assert_same_state, load_state, run_ranks
from tests.workers.sidecar_stub import SidecarStub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # minutes only on a loaded machine

SNAPSHOT_STEP = 6  # the newest snapshot when rank 1 holds step 7 (snapshots every 2 steps)
LONG_WAIT = 600  # a run's whole life on a loaded machine (torch's import alone can take a minute)
SNAPSHOT = ("--snapshot-every", "2")


def wait_for_files(paths: list[Path], run: Run, timeout: float = LONG_WAIT) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if any(p.poll() is not None for p in run.procs):
            raise AssertionError(f"a rank exited early:\n{run.tail()}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {[p.name for p in paths]}:\n{run.tail()}")
        time.sleep(0.02)


def checkpoints(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))


def messages(tmp: Path, tag: str) -> list[dict]:
    return [json.loads((tmp / f"term-{tag}-{r}").read_text()) for r in range(2)]


def term_env(tmp: Path, tag: str, extra: dict | None = None) -> dict[int, dict[str, str]]:
    return {r: {"SPOTGUARD_TERMINATION_LOG": str(tmp / f"term-{tag}-{r}"), **(extra or {})} for r in range(2)}


def signalled_run(tmp: Path, tag: str, args: list[str], grace: float, ready: list[str],
                  signal_ranks=(1,)) -> tuple[list[int], float, float, Run]:
    """Runs 2 ranks; once every file in `ready` exists in their out dir, SIGTERM to `signal_ranks`.
    Returns (exit codes, seconds from the signal to the last exit, the deadline's distance, the run)."""
    out = tmp / tag
    with Run(2, [*args, "--out", str(out), "--grace", str(grace)], out / "logs", rank_env=term_env(tmp, tag)) as run:
        wait_for_files([out / name for name in ready], run)
        signalled = time.monotonic()
        for rank in signal_ranks:
            run.procs[rank].send_signal(signal.SIGTERM)
        codes = run.wait(grace + 60)
        return codes, time.monotonic() - signalled, grace, run


def uninterrupted_state(out: Path, steps: int) -> dict:
    """The final state of 2 DDP ranks that trained `steps` steps without a notice."""
    codes, tail = run_ranks(2, ["--mode", "ddp", "--ckpt", str(out / "ckpt"), "--out", str(out), "--steps",
                                str(steps)], out / "logs", timeout=LONG_WAIT)
    assert codes == [0, 0], tail
    return load_state(out / "state-final.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The state of an uninterrupted run after step SNAPSHOT_STEP (what the watchdog must persist)."""
    return uninterrupted_state(tmp_path_factory.mktemp("reference"), SNAPSHOT_STEP + 1)


def test_a_long_step_past_the_deadline_persists_the_snapshot_and_every_rank_leaves_before_it(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    base = ["--mode", "ddp", "--ckpt", str(ckpt), "--steps", "1000", *SNAPSHOT, "--hold-rank", "1"]
    # 1. rank 1 holds step 7 for good (the snapshot of step 6 is the newest); 10 s grace
    codes, took, grace, run = signalled_run(tmp_path, "long", [*base, "--hold-at", "7"], 10, ["holding-1"])
    assert codes == [83, 83], run.tail()
    assert took < grace, f"the ranks left {took:.1f}s after the signal, past the {grace}s deadline"
    assert checkpoints(ckpt) == ["step-000000006-notice"]
    for m in messages(tmp_path, "long"):
        assert (m["checkpoint"], m["saved_by"], m["saved_step"], m["steps_lost"]) == ("durable", "watchdog", 6, 0), m
        assert 0 < m["margin_seconds"] < grace, m
    # 2. resumed, and a notice during the long first step: nothing new to save -> 83 at once
    codes, took, grace, run = signalled_run(tmp_path, "first", [*base, "--hold-at", "7"], 30, ["holding-1"])
    assert codes == [83, 83], run.tail()
    assert checkpoints(ckpt) == ["step-000000006-notice"]  # no second save
    for m in messages(tmp_path, "first"):
        assert (m["saved_by"], m["steps_lost"], m["checkpoint"]) == ("nothing-new", 0, "durable"), m
        assert m["margin_seconds"] > grace / 2, m  # at once, not at the latest safe moment
    # 3. the persisted snapshot resumed bit-exactly (the state just loaded: parameters, Adam moments
    # and step counts equal an uninterrupted run's after step 6), at step 7: no rank finished a step
    # in that run before its first (held) one
    resumed = tmp_path / "first"
    assert not list(resumed.glob("progress-*")), run.tail()
    assert_same_state(load_state(resumed / "state-resume.pt"), reference)


@contextlib.contextmanager
def long_step_with_sidecar(tmp_path: Path, tag: str) -> Iterator[tuple[SidecarStub, Run]]:
    """2 DDP ranks (snapshots every 2 steps) with rank 1 holding step 7 for good and connected to a
    sidecar stub; yields once rank 1 holds and its Guard listens."""
    ckpt, out, token = tmp_path / "ckpt", tmp_path / tag, tmp_path / "token"
    with SidecarStub() as stub:
        token.write_text(stub.token)
        env = term_env(tmp_path, tag)
        env[1].update(SPOTGUARD_SIDECAR_URL=stub.url, SPOTGUARD_TOKEN_FILE=str(token))
        args = ["--mode", "ddp", "--ckpt", str(ckpt), "--out", str(out), "--steps", "1000", *SNAPSHOT,
                "--hold-at", "7", "--hold-rank", "1", "--no-compare"]
        with Run(2, args, out / "logs", rank_env=env) as run:
            wait_for_files([out / "holding-1"], run)
            stub.wait_for_connection(run.procs)
            yield stub, run


def reclaim(nid: str, seconds: float) -> dict:
    now = now_utc()
    return Notice(id=nid, kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                  deadline=now + timedelta(seconds=seconds)).to_wire()


def persisted_by_the_watchdog(tmp_path: Path, tag: str, stub: SidecarStub, run: Run, nid: str) -> list[dict]:
    """Pushes reclaim `nid` (8 s) to rank 1: both ranks leave with 83 before its deadline, the
    snapshot of step 6 the one checkpoint; returns their termination messages."""
    grace = 8.0
    sent = time.monotonic()
    stub.push("notice", reclaim(nid, grace))
    codes = run.wait(grace + 60)
    took = time.monotonic() - sent
    assert codes == [83, 83], run.tail()
    assert took < grace, took
    assert checkpoints(tmp_path / "ckpt") == ["step-000000006-notice"]
    return messages(tmp_path, tag)


def test_a_sidecar_notice_during_a_long_step_is_answered_by_the_watchdog(tmp_path):
    with long_step_with_sidecar(tmp_path, "side") as (stub, run):
        answers = persisted_by_the_watchdog(tmp_path, "side", stub, run, "aws.spot:long-step")
    assert all(m["saved_by"] == "watchdog" and m["notice_id"] == "aws.spot:long-step" for m in answers)
    phases = [(r["phase"], r.get("saved_by"), r["step"]) for r in stub.reports]
    assert ("checkpoint-durable", "watchdog", 6) in phases and ("drained", "watchdog", 6) in phases, phases


def test_a_reclaim_after_a_withdrawn_notice_reaches_every_rank_during_a_long_step(tmp_path):
    """The same node twice in one long step: a notice reaches rank 1 (rank 0 learns it through the
    store: its advance message names it), is withdrawn (rank 0 empties its message), then a
    reclaim comes to rank 1. Rank 0 learns the reclaim through the store too, both persist the
    snapshot of step 6 and leave with 83 before the deadline. A rank published once per
    formation: rank 0 never learned the reclaim and could not persist with rank 1."""
    rank0_message = tmp_path / "term-twice-0"

    def rank0_says(run: Run, predicate: Callable[[str], bool]) -> None:
        end = time.monotonic() + LONG_WAIT
        while not predicate(rank0_message.read_text() if rank0_message.exists() else ""):
            assert all(p.poll() is None for p in run.procs) and time.monotonic() < end, run.tail()
            time.sleep(0.02)

    with long_step_with_sidecar(tmp_path, "twice") as (stub, run):
        stub.push("notice", reclaim("aws.spot:first", 60))
        rank0_says(run, lambda text: "aws.spot:first" in text)
        stub.push("withdrawn", {"v": 1, "withdrawn": "aws.spot:first", "source": "aws.spot", "node": "n1",
                                "reason": "canceled"})
        rank0_says(run, lambda text: text == "")
        answers = persisted_by_the_watchdog(tmp_path, "twice", stub, run, "aws.spot:second")
    assert [(m["notice_id"], m["saved_by"], m["checkpoint"]) for m in answers] == [
        ("aws.spot:second", "watchdog", "durable")] * 2


def test_a_notice_while_the_model_is_built_leaves_with_83_at_once(tmp_path):
    args = ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--steps", "5", "--hold-build"]
    codes, took, grace, run = signalled_run(tmp_path, "build", args, 30, ["building-0", "building-1"],
                                            signal_ranks=(0, 1))  # torchrun forwards SIGTERM to every rank
    assert codes == [83, 83], run.tail()
    assert took < grace, took
    assert [(m["saved_by"], m["steps_lost"]) for m in messages(tmp_path, "build")] == [("nothing-new", 0)] * 2


def test_an_async_save_that_cannot_finish_is_abandoned_with_84(tmp_path):
    """The periodic async save of step 5 never finishes writing; the main threads wait for it at the
    snapshot of step 6. The watchdog abandons it: 84, the async checkpoint of step 0 stays the newest."""
    ckpt = tmp_path / "ckpt"
    args = ["--mode", "ddp", "--ckpt", str(ckpt), "--steps", "1000", *SNAPSHOT, "--save-every", "5",
            "--slow-async-from", "5", "--no-compare"]
    codes, took, grace, run = signalled_run(tmp_path, "async", args, 8, ["slow-async-0", "slow-async-1"])
    assert codes == [84, 84], run.tail()
    assert took < grace, took
    assert checkpoints(ckpt) == ["step-000000000-periodic"]
    for m in messages(tmp_path, "async"):
        assert (m["checkpoint"], m["async_save"], m["why"]) == ("failed", "abandoned", "async-abandoned"), m


def test_a_failing_persist_leaves_with_84_and_the_previous_checkpoint_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--mode", "ddp", "--ckpt", str(ckpt), "--steps", "1000", *SNAPSHOT, "--save-every", "100",
            "--hold-at", "7", "--hold-rank", "1", "--fail-notice-write", "--no-compare"]
    codes, took, grace, run = signalled_run(tmp_path, "fail", args, 8, ["holding-1"])
    assert codes == [84, 84], run.tail()
    assert took < grace, took
    assert checkpoints(ckpt) == ["step-000000000-periodic"]
    for m in messages(tmp_path, "fail"):
        assert (m["checkpoint"], m["why"], m["steps_lost"]) == ("failed", "persist-failed", 6), m


def test_deepspeed_a_long_step_past_the_deadline_persists_the_held_snapshot(tmp_path):
    """DeepSpeedAdapter's snapshot is DeepSpeed's own capture at the boundary (collective, on the
    main thread); its persist writes each file locally: the watchdog persists it like any other."""
    ckpt = tmp_path / "ckpt"
    args = ["--mode", "deepspeed", "--ckpt", str(ckpt), "--steps", "1000", *SNAPSHOT, "--hold-at", "7",
            "--hold-rank", "1", "--no-compare"]
    codes, took, grace, run = signalled_run(tmp_path, "ds", args, 8, ["holding-1"])
    assert codes == [83, 83], run.tail()
    assert took < grace, took
    assert checkpoints(ckpt) == ["step-000000006-notice"]
    assert [m["saved_by"] for m in messages(tmp_path, "ds")] == ["watchdog"] * 2
