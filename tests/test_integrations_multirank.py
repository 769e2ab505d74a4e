"""The framework integrations across real ranks (DDP on gloo, 2 ranks, tiny model made in code).

For the Trainer, Accelerate and Lightning, one test each, three runs of the reference script:
1. two ranks; a notice delivered to ONE rank mid-epoch (the stand-in sidecar only rank 1
   connects to, or SIGTERM to rank 1 alone) makes every rank save the same global step through
   the one snapshot engine, in the framework's own format, committed by the store; both exit 83;
   the framework's own resume picks that checkpoint;
2. two ranks resume from it with rank 0's save failing (`--fail-save`): a second notice ends the
   run with 84 on every rank (no rank left waiting) and the previous checkpoint stays the newest,
   nothing staged left behind;
3. one rank (2 -> 1) resumes: it starts at the saved step (0 steps lost) with the optimizer state
   equal bit for bit to the state at the agreed step, and every later global batch is the one the
   fixed data order gives (the data position continues).
Most of each test's time is the frameworks' imports (several seconds per process on a loaded machine).
"""
from __future__ import annotations

import pytest
import torch

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.trainer.framework_refs import expected_ids
from tests.framework_runs import (RESUME_OFFSET, TOTAL, assert_same_optimizer_state, complete_run, ids_by_step,
                                  interrupted_run, optimizer_state, resumed, saved_steps)

pytestmark = pytest.mark.slow

DELIVERY = {"hf": "sidecar", "accelerate": "sigterm", "lightning": "sigterm"}


def newest_step(framework: str, ckpt) -> int:
    """The step of the newest checkpoint the framework's own resume picks."""
    if framework == "hf":
        from transformers.trainer_utils import get_last_checkpoint

        return int(get_last_checkpoint(str(ckpt)).rsplit("-", 1)[1])
    if framework == "accelerate":
        return CheckpointStore(ckpt).resolve().step
    return torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"]


def staged_leftovers(ckpt) -> list[str]:
    """What a failed or killed save left, once the store was opened again (as the next run does): the
    pending directory of a dead writer is removed then; nothing else may be left."""
    CheckpointStore(ckpt)
    return [p.name for p in ckpt.iterdir()
            if "spotguard-tmp" in p.name or p.name.startswith((".pending-", ".spotguard-"))]


def engine_checkpoint(ckpt, step: int) -> dict:
    """The metadata of the store's newest checkpoint, which the one engine committed for the notice at `step`."""
    info = CheckpointStore(ckpt).resolve(verify=True)
    assert info is not None and info.metadata["reason"] == "notice", info
    return info.metadata


@pytest.mark.timeout(1800)  # three runs; minutes only on a loaded machine (imports)
@pytest.mark.parametrize("framework", ["hf", "accelerate", "lightning"])
def test_notice_to_one_rank_same_step_failed_save_84_resume_on_one_rank(framework, tmp_path):
    ckpt, first, failing, last = tmp_path / "ckpt", tmp_path / "first", tmp_path / "failing", tmp_path / "last"
    offset = RESUME_OFFSET[framework]

    codes, stub, tail = interrupted_run(framework, tmp_path, ckpt, first, DELIVERY[framework])
    assert codes == [83, 83], tail
    steps = saved_steps(first, 2)
    step = steps[0]
    assert steps == [step, step] and step + offset < TOTAL - 3, steps
    assert newest_step(framework, ckpt) == step
    assert engine_checkpoint(ckpt, step)["step"] == step  # through the one engine and the store's commit
    if stub is not None:  # only rank 1 has a sidecar: it hears that the checkpoint is durable, then drained
        assert [(r["phase"], r["rank"], r["step"]) for r in stub.reports] == [
            ("checkpoint-durable", 1, step), ("drained", 1, step)]

    codes, _stub, tail = interrupted_run(framework, tmp_path, ckpt, failing, "sigterm", "--fail-save",
                                         after_step=step + offset + 1)
    assert codes == [84, 84], tail
    assert resumed(failing)["start"] == step + offset
    assert newest_step(framework, ckpt) == step and staged_leftovers(ckpt) == []

    complete_run(framework, 1, ckpt, last)
    start = step + offset
    assert resumed(last) == {"start": start, "optimizer_steps": [start]}  # 0 steps lost
    assert_same_optimizer_state(optimizer_state(first, "saved"), optimizer_state(last, "resumed"))
    got = ids_by_step(last, 1)
    assert sorted(got) == list(range(start + 1, TOTAL + 1))
    assert all(got[s] == expected_ids(s) for s in got), "the data position did not continue"
    assert ids_by_step(first, 2)[1] == expected_ids(1)


@pytest.mark.timeout(1200)  # two runs; minutes only on a loaded machine (imports)
def test_hf_trainer_deepspeed_zero2_notice_to_one_rank_same_step_resume(tmp_path):
    """The Trainer's own DeepSpeed plugin (ZeRO-2, gloo on CPU) on the restart path: a notice to rank 1
    alone makes both ranks save the same step through `engine.save_checkpoint` (inside the Trainer's
    checkpoint), exit 83; `train(resume_from_checkpoint=True)` on 2 ranks continues from that step with
    rank 0's optimizer partition equal bit for bit and the data position continuing. (A resume at another
    world size needs DeepSpeed's universal checkpoint: not covered here.)"""
    ckpt, first, last = tmp_path / "ckpt", tmp_path / "first", tmp_path / "last"
    deepspeed = ("--deepspeed-stage", "2")

    codes, stub, tail = interrupted_run("hf", tmp_path, ckpt, first, "sidecar", *deepspeed)
    assert codes == [83, 83], tail
    steps = saved_steps(first, 2)
    step = steps[0]
    assert steps == [step, step] and step < TOTAL - 3, steps
    assert newest_step("hf", ckpt) == step and staged_leftovers(ckpt) == []
    assert engine_checkpoint(ckpt, step)["step"] == step
    assert (ckpt / f"checkpoint-{step}" / f"global_step{step}").is_dir()  # DeepSpeed's own layout inside
    assert [(r["phase"], r["rank"], r["step"]) for r in stub.reports] == [
        ("checkpoint-durable", 1, step), ("drained", 1, step)]

    complete_run("hf", 2, ckpt, last, *deepspeed)
    assert resumed(last) == {"start": step, "optimizer_steps": [step]}  # 0 steps lost
    assert_same_optimizer_state(optimizer_state(first, "saved"), optimizer_state(last, "resumed"))
    got = ids_by_step(last, 2)
    assert sorted(got) == list(range(step + 1, TOTAL + 1))
    assert all(got[s] == expected_ids(s) for s in got), "the data position did not continue"


@pytest.mark.timeout(1200)  # two runs; minutes only on a loaded machine (imports)
def test_accelerate_deepspeed_zero2_notice_to_one_rank_same_step_resume(tmp_path):
    """Accelerate's DeepSpeed plugin (ZeRO-2, gloo on CPU) on the restart path: SIGTERM to rank 1 alone
    makes both ranks `save_state` the same step (DeepSpeed's own checkpoint inside the store's commit),
    exit 83; `guard.resume()` on 2 ranks continues from that step with rank 0's optimizer partition
    equal bit for bit and the data position continuing."""
    ckpt, first, last = tmp_path / "ckpt", tmp_path / "first", tmp_path / "last"
    deepspeed = ("--deepspeed-stage", "2")

    codes, _stub, tail = interrupted_run("accelerate", tmp_path, ckpt, first, "sigterm", *deepspeed)
    assert codes == [83, 83], tail
    steps = saved_steps(first, 2)
    step = steps[0]
    assert steps == [step, step] and step + 1 < TOTAL - 3, steps
    assert newest_step("accelerate", ckpt) == step and staged_leftovers(ckpt) == []
    assert engine_checkpoint(ckpt, step)["step"] == step

    complete_run("accelerate", 2, ckpt, last, *deepspeed)
    start = step + 1
    assert resumed(last) == {"start": start, "optimizer_steps": [start]}  # 0 steps lost
    assert_same_optimizer_state(optimizer_state(first, "saved"), optimizer_state(last, "resumed"))
    got = ids_by_step(last, 2)
    assert sorted(got) == list(range(start + 1, TOTAL + 1))
    assert all(got[s] == expected_ids(s) for s in got), "the data position did not continue"
