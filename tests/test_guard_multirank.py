"""The Guard across real ranks (gloo on 127.0.0.1): one rank's notice -> the same step everywhere.

The notice reaches exactly one rank: only that rank's SPOTGUARD_SIDECAR_URL points at the
stand-in sidecar (a real aiohttp server), or only torchrun gets SIGTERM. Every rank must
checkpoint the same step and leave with 83; resuming continues bit-exactly (parameters and
Adam moments equal to an uninterrupted run). The two 2-rank notices (one saved at the agreed step,
one whose deadline is too short for it) are one chain: the second run resumes from the first's
checkpoint and the last resume ends where an uninterrupted run does, so one resume checks both.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.wire.notice import Notice, now_utc
from tests.workers.launch import (ROOT, TRAINER, Run, assert_same_state, base_env, exits, load_state, run_ranks,
                                  saved, wait_for_progress)
from tests.workers.sidecar_stub import SidecarStub

pytestmark = pytest.mark.slow

TOTAL = 40  # steps of the reference run; the last resumed run ends at the same step, past both notices


def notice(seconds: float, nid: str) -> dict:
    now = now_utc()
    return Notice(id=nid, kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                  deadline=now + timedelta(seconds=seconds)).to_wire()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank DDP run of TOTAL steps: its final full state."""
    out = tmp_path_factory.mktemp("reference")
    codes, tail = run_ranks(2, ["--mode", "ddp", "--ckpt", str(out / "ckpt"), "--out", str(out), "--steps", str(TOTAL)],
                            out / "logs")
    assert codes == [0, 0], tail
    return load_state(out / "state-final.pt")


def interrupted_by_sidecar(tmp_path, world: int, target_rank: int, seconds: float, extra=(), name: str = "first",
                           after_step: int = 2, nid: str = "aws.spot:one-rank") -> tuple[SidecarStub, list]:
    """Runs `world` DDP ranks; once rank 0 finished `after_step`, the stand-in sidecar sends one
    notice, seen only by `target_rank`."""
    out = tmp_path / name
    token = tmp_path / "token"
    with SidecarStub() as stub:
        token.write_text(stub.token)
        env = {target_rank: {"SPOTGUARD_SIDECAR_URL": stub.url, "SPOTGUARD_TOKEN_FILE": str(token)}}
        args = ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--steps", "1000",
                "--step-sleep", "0.05", *extra]
        with Run(world, args, out / "logs", rank_env=env) as run:
            wait_for_progress(out, 0, after_step, procs=run.procs)
            stub.wait_for_connection(run.procs)
            stub.push("notice", notice(seconds, nid))
            codes = run.wait(120)
            assert codes == [83] * world, run.tail()
        records = saved(out, world)
        return stub, records


def resume_to_total(tmp_path, world: int = 2):
    out = tmp_path / "resumed"
    codes, tail = run_ranks(world, ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
                                    "--steps", str(TOTAL)], out / "logs")
    assert codes == [0] * world, tail
    return load_state(out / "state-final.pt")


def test_notice_to_one_of_two_ranks_same_step_then_a_deadline_too_short_persists_the_last_snapshot(tmp_path,
                                                                                                  reference):
    step = notice_to_one_of_two_ranks_same_step(tmp_path)
    deadline_too_short_persists_last_snapshot(tmp_path, resumed_at=step + 1)
    # both checkpoints held the right state: resuming ends exactly where an uninterrupted run does
    assert_same_state(reference, resume_to_total(tmp_path))


def notice_to_one_of_two_ranks_same_step(tmp_path) -> int:
    stub, records = interrupted_by_sidecar(tmp_path, 2, target_rank=1, seconds=120)
    step = records[0]["step"]
    assert [r["step"] for r in records] == [step, step] and step < TOTAL - 1
    assert {r["notice"] for r in records} == {"aws.spot:one-rank"}  # rank 0 learned the notice from rank 1
    assert all(r["ok"] and not r["snapshot"] for r in records)
    info = CheckpointStore(tmp_path / "ckpt").resolve()
    assert info.step == step and info.metadata["notice_id"] == "aws.spot:one-rank"
    phases = [(r["phase"], r["rank"], r["step"]) for r in stub.reports]
    assert phases == [("checkpoint-durable", 1, step), ("drained", 1, step)]  # only rank 1 has a sidecar
    return step


def deadline_too_short_persists_last_snapshot(tmp_path, resumed_at: int) -> None:
    """Resumed at `resumed_at`: the notice comes once a snapshot step (even) after it was trained."""
    stub, records = interrupted_by_sidecar(tmp_path, 2, target_rank=1, seconds=0.3, name="second",
                                           after_step=resumed_at + 3, nid="aws.spot:short-deadline",
                                           extra=["--snapshot-every", "2"])
    step, saved_step = records[0]["step"], records[0]["saved_step"]
    assert all(r["snapshot"] and r["saved_step"] == saved_step and r["step"] == step for r in records)
    assert saved_step % 2 == 0 and resumed_at <= saved_step < step < TOTAL - 1
    info = CheckpointStore(tmp_path / "ckpt").resolve()
    assert info.step == saved_step and info.metadata["snapshot"] is True
    durable = [r for r in stub.reports if r["phase"] == "checkpoint-durable"]
    assert durable and durable[0]["step"] == saved_step and durable[0]["steps_lost"] == step - saved_step


def test_notice_to_one_of_three_ranks(tmp_path):
    """More than two ranks (3: the property is the same at any size above two; a rank fewer than
    4 costs a process less): the last one's notice reaches the others, one step everywhere."""
    _stub, records = interrupted_by_sidecar(tmp_path, 3, target_rank=2, seconds=120, extra=["--no-compare"])
    assert len({r["step"] for r in records}) == 1 and all(r["ok"] for r in records)
    assert exits(tmp_path / "first", 3) == [83] * 3
    assert CheckpointStore(tmp_path / "ckpt").resolve().world_size == 3


def test_sigterm_to_torchrun_checkpoints_a_consistent_step_and_exits_83(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = base_env()
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "20"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
               str(TRAINER), "--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--steps", "1000",
               "--step-sleep", "0.05", "--no-compare"]
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_progress(out, 1, 2, procs=[proc])
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log_text = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert exits(out, 2) == [83, 83], log_text[-3000:]
    records = saved(out, 2)
    assert records[0]["step"] == records[1]["step"] and all(r["kind"] == "drain" and r["ok"] for r in records)
    assert CheckpointStore(tmp_path / "ckpt").resolve().step == records[0]["step"]
    assert code != 0  # torchrun itself reports that it was stopped
