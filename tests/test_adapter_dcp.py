"""torch DCP adapter: DDP and FSDP2 checkpoints taken at a notice reshard 2 -> 1 -> 2 ranks exactly;
periodic async saves commit while training goes on, and a resume picks the newest.

Each notice leg: the job runs, rank 1 gets SIGTERM after a given step (a real signal), every rank
checkpoints the agreed step and exits 83; the next leg resumes at the other world size and its
state right after loading equals, bit for bit, the state the previous leg saved. DDP's 2-rank
resume leg is also the async-save run (a resume leg proves only its load; how 2 ranks drain at a
notice, legs before it prove): it trains on with periodic async saves and ends normally.
"""
from __future__ import annotations

import pytest

from tests.workers.launch import assert_same_state, exits, load_state, run_ranks, saved

pytestmark = pytest.mark.slow


def leg(tmp_path, name: str, world: int, mode: str, signal_at: int, extra=()):
    out = tmp_path / name
    args = ["--mode", mode, "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--steps", "1000",
            "--signal-at", str(signal_at), "--signal-rank", str(world - 1), *extra]
    codes, tail = run_ranks(world, args, out / "logs")
    assert codes == [83] * world, tail
    assert exits(out, world) == [83] * world
    records = saved(out, world)
    assert len({r["step"] for r in records}) == 1, records  # every rank checkpointed the same step
    assert all(r["ok"] and r["kind"] == "drain" for r in records)
    return out, records[0]["step"]


def reshard_2_1(tmp_path, mode: str):
    """2 ranks drain at a notice, 1 rank resumes exactly and drains again; returns (that leg, its step)."""
    first, step1 = leg(tmp_path, "w2", 2, mode, signal_at=3)
    # The signal comes after step 3's backward. FSDP2 (the Guard's own agreement) acts at that very
    # boundary; DDP carries the flag in the gradient all_reduce (piggyback), so it rides in step 4's.
    assert step1 == (4 if mode == "ddp" else 3)
    second, step2 = leg(tmp_path, "w1", 1, mode, signal_at=step1 + 3, extra=["--signal-rank", "0"])
    assert step2 == step1 + 3  # one rank: the signal is seen at the very step it was sent
    assert_same_state(load_state(first / "state-save.pt"), load_state(second / "state-resume.pt"))
    return second, step2


def test_fsdp2_reshards_2_1_2_exactly(tmp_path):
    second, step2 = reshard_2_1(tmp_path, "fsdp2")
    third, _ = leg(tmp_path, "w2b", 2, "fsdp2", signal_at=step2 + 2)
    assert_same_state(load_state(second / "state-save.pt"), load_state(third / "state-resume.pt"))


def test_ddp_reshards_2_1_2_exactly_and_async_periodic_saves_commit_and_resume(tmp_path):
    """Periodic async saves (own gloo group) complete while training goes on; resume picks the newest."""
    second, step2 = reshard_2_1(tmp_path, "ddp")
    third = tmp_path / "w2b"
    end = step2 + 8
    newest = max(s for s in range(step2 + 1, end) if s % 3 == 0)  # the last periodic (async) save
    args = ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(third), "--steps", str(end),
            "--save-every", "3"]
    codes, tail = run_ranks(2, args, third / "logs")
    assert codes == [0, 0], tail
    assert_same_state(load_state(second / "state-save.pt"), load_state(third / "state-resume.pt"))
    assert (tmp_path / "ckpt" / f"step-{newest:09d}-periodic").is_dir()  # committed while training went on
    resumed = tmp_path / "resumed"
    args = ["--mode", "ddp", "--ckpt", str(tmp_path / "ckpt"), "--out", str(resumed), "--steps", str(end + 1)]
    codes, tail = run_ranks(2, args, resumed / "logs")
    assert codes == [0, 0], tail
    assert (resumed / "state-resume.pt").exists()  # resumed from the newest (async) checkpoint
    assert int((resumed / "progress-0").read_text()) == end
