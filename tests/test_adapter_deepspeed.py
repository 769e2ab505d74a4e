"""DeepSpeed adapter: ZeRO-1 and ZeRO-2 checkpoints taken at a notice resume at 2 -> 1 -> 2 ranks exactly.

A change of data-parallel world size makes the adapter convert the checkpoint to DeepSpeed's
universal format (ds_to_universal --inject_missing_state) and load it with load_universal; the
state right after loading (fp32 parameters, Adam moments, global step) equals, bit for bit,
the state the previous leg saved. The universal copy is the one of exactly the commit it was made
from: a tag committed again (other content) loses its copy, and the next resume converts anew.

One chain of legs in one store (a DeepSpeed process and each conversion import far more than
torch, so every leg's checkpoint is the next leg's start and is checked for all it proves):
ZeRO-1 at 2 -> 1 -> 2 ranks; then ZeRO-2 trained afresh at 2 ranks re-commits the tag the ZeRO-1
1-rank leg committed (whose copy the 2-rank leg made), and resumes 2 -> 1 -> 2 from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotguard.hooks.checkpoint import CheckpointStore
from spotguard.hooks.checkpoint.derived import SOURCE
from tests.workers.launch import assert_same_state, exits, load_state, run_ranks, saved

pytestmark = pytest.mark.slow


def leg(tmp_path, name: str, world: int, stage: int, signal_at: int, *extra: str) -> tuple[Path, str]:
    """`world` ranks at ZeRO `stage`; the last rank SIGTERMs itself after `signal_at`: all save that step, exit 83."""
    out = tmp_path / name
    args = ["--mode", "deepspeed", "--zero-stage", str(stage), "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
            "--steps", "1000", "--signal-at", str(signal_at), "--signal-rank", str(world - 1), *extra]
    codes, tail = run_ranks(world, args, out / "logs", timeout=240)
    assert codes == [83] * world, tail
    assert exits(out, world) == [83] * world
    records = saved(out, world)
    assert {r["step"] for r in records} == {signal_at}, records
    return out, tail


def copy_source(tmp_path, tag: str) -> str | None:
    try:
        return json.loads((tmp_path / "ckpt" / "_universal" / tag / SOURCE).read_text())["fingerprint"]
    except FileNotFoundError:
        return None


def resumed_exactly_through_the_universal_form(saved_leg: Path, resumed_leg: Path, tail: str, step: int) -> None:
    assert "loading its universal form" in tail
    resumed = load_state(resumed_leg / "state-resume.pt")
    assert int(resumed["global_steps"]) == step + 1
    assert_same_state(load_state(saved_leg / "state-save.pt"), resumed)


def the_copy_is_of_exactly_that_commit(tmp_path, store: CheckpointStore, tag: str) -> None:
    assert copy_source(tmp_path, tag) == store.read(tag).fingerprint


def resume_2_1_2(tmp_path, store: CheckpointStore, stage: int, first: Path, step: int) -> tuple[str, int]:
    """From `first`'s 2-rank checkpoint of `step`: 1 rank, then 2, each resume exact; returns the
    tag and step of the 1-rank leg's checkpoint (its universal copy made by the 2-rank leg)."""
    tag = store.latest().tag
    second, tail = leg(tmp_path, f"s{stage}-w1", 1, stage, step + 2)
    resumed_exactly_through_the_universal_form(first, second, tail, step)
    the_copy_is_of_exactly_that_commit(tmp_path, store, tag)
    tag = store.latest().tag
    third, tail = leg(tmp_path, f"s{stage}-w2b", 2, stage, step + 4)
    resumed_exactly_through_the_universal_form(second, third, tail, step + 2)
    the_copy_is_of_exactly_that_commit(tmp_path, store, tag)
    return tag, step + 2


def a_recommit_drops_the_copy_of_the_commit_it_replaced(tmp_path, store: CheckpointStore, tag: str) -> None:
    assert store.latest().tag == tag
    assert copy_source(tmp_path, tag) is None, "a copy of a commit that is gone was kept"
    assert not list((tmp_path / "ckpt" / "_universal").glob(".build-*"))


def test_zero1_and_zero2_resume_2_1_2_exactly_and_the_universal_copy_follows_its_commit(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", clean=False)
    first, _ = leg(tmp_path, "s1-w2", 2, 1, 2)
    tag, step = resume_2_1_2(tmp_path, store, 1, first, 2)
    # ZeRO-2 from scratch at 2 ranks commits that tag again, other content: the copy goes; the
    # 1-rank leg that resumes it converts this commit (its state is this commit's, not the copy's)
    again, _ = leg(tmp_path, "s2-w2", 2, 2, step, "--fresh")
    a_recommit_drops_the_copy_of_the_commit_it_replaced(tmp_path, store, tag)
    resume_2_1_2(tmp_path, store, 2, again, step)
