"""DeepSpeed adapter: ZeRO-1 and ZeRO-2 checkpoints taken at a notice resume at 2 -> 1 -> 2 ranks exactly.

A change of data-parallel world size makes the adapter convert the checkpoint to DeepSpeed's
universal format (ds_to_universal --inject_missing_state) and load it with load_universal; the
state right after loading (fp32 parameters, Adam moments, global step) equals, bit for bit,
the state the previous leg saved.
"""
from __future__ import annotations

import pytest

import json

from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.hooks.checkpoint.derived import SOURCE
from tests.workers.launch import assert_same_state, exits, load_state, run_ranks, saved

pytestmark = pytest.mark.slow


def leg(tmp_path, name: str, world: int, stage: int, signal_at: int, *extra: str):
    out = tmp_path / name
    args = ["--mode", "deepspeed", "--zero-stage", str(stage), "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
            "--steps", "1000", "--signal-at", str(signal_at), "--signal-rank", str(world - 1), *extra]
    codes, tail = run_ranks(world, args, out / "logs", timeout=240)
    assert codes == [83] * world, tail
    assert exits(out, world) == [83] * world
    records = saved(out, world)
    assert {r["step"] for r in records} == {signal_at}, records
    return out, signal_at, tail


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_resume_2_1_2_exact(tmp_path, stage):
    first, step1, _ = leg(tmp_path, "w2", 2, stage, signal_at=2)
    second, step2, tail = leg(tmp_path, "w1", 1, stage, signal_at=step1 + 2)
    assert "loading its universal form" in tail
    assert (tmp_path / "ckpt" / "_universal").is_dir()
    saved_state, resumed = load_state(first / "state-save.pt"), load_state(second / "state-resume.pt")
    assert int(resumed["global_steps"]) == step1 + 1
    assert_same_state(saved_state, resumed)
    third, _, _ = leg(tmp_path, "w2b", 2, stage, signal_at=step2 + 2)
    assert_same_state(load_state(second / "state-save.pt"), load_state(third / "state-resume.pt"))



def resume_only(tmp_path, name: str, world: int, step: int):
    """A leg that only resumes (from the checkpoint of `step`) and exits: no training, no save."""
    out = tmp_path / name
    args = ["--mode", "deepspeed", "--zero-stage", "1", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
            "--steps", str(step + 1)]
    codes, tail = run_ranks(world, args, out / "logs", timeout=240)
    assert codes == [0] * world, tail
    assert "loading its universal form" in tail
    return out


def copy_source(tmp_path, tag: str) -> str | None:
    try:
        return json.loads((tmp_path / "ckpt" / "_universal" / tag / SOURCE).read_text())["fingerprint"]
    except FileNotFoundError:
        return None


def test_universal_copy_follows_its_commit(tmp_path):
    first, step, _ = leg(tmp_path, "w2", 2, 1, signal_at=2)
    store = CheckpointStore(tmp_path / "ckpt", clean=False)
    tag = store.latest().tag
    resume_only(tmp_path, "w1", 1, step)
    assert copy_source(tmp_path, tag) == store.read(tag).fingerprint
    # the same tag committed again with other content (trained from scratch at 1 rank, not 2)
    again, _, _ = leg(tmp_path, "w1-fresh", 1, 1, step, "--fresh")
    assert store.latest().tag == tag
    assert copy_source(tmp_path, tag) is None, "a copy of a commit that is gone was kept"
    assert not list((tmp_path / "ckpt" / "_universal").glob(".build-*"))
    resumed = resume_only(tmp_path, "w2-resume", 2, step)
    assert copy_source(tmp_path, tag) == store.read(tag).fingerprint
    assert_same_state(load_state(again / "state-save.pt"), load_state(resumed / "state-resume.pt"))
