"""The framework integrations across real ranks (DDP on gloo, tiny model made in code), on the
restart path: every change of world size a relaunch of every rank from the checkpoint.

For the Trainer, Accelerate and Lightning, one test each, four runs of the reference script, each
rank's data dealt by `spotguard.data.ElasticSampler` through the integration (`sampler=`), each
rank's batch kept (`--keep-batch rank`: 4 samples per rank, so the global batch is 8, 4, 8 and the
steps per epoch change with the world: the frameworks' own epoch arithmetic at a new world size):
1. two ranks; a notice delivered to ONE rank mid-epoch (the stand-in sidecar only rank 1
   connects to, or SIGTERM to rank 1 alone) makes every rank save the same global step through
   the one snapshot engine, in the framework's own format, committed by the store; both exit 83;
   the framework's own resume picks that checkpoint;
2. two ranks resume from it with rank 0's save failing (`--fail-save`): a second notice ends the
   run with 84 on every rank (no rank left waiting) and the previous checkpoint stays the newest,
   nothing staged left behind;
3. one rank (the shrink, 2 -> 1) resumes: it starts at the saved step (0 steps lost) with the
   optimizer state equal bit for bit to the state at the agreed step; a notice drains it (83);
4. two ranks (the grow, 1 -> 2) resume from that, the same way, and train to the end.
The sample ledger of runs 1, 3 and 4 (run 2's steps after the checkpoint were lost with its failed
save, and run 3 trains them again): every step trained once, by every rank of its world; each epoch
every sample exactly once (tests/ledger.py); and every global batch the one the fixed data order
gives (the data position continues through both changes of world size).
The global batch kept (`--keep-batch global`: the per-device batch changes with the world instead)
is tests/test_integrations_deadline.py's resume on one rank for the Trainer and Lightning (the same
assertions: 0 steps lost, the optimizer state bit for bit, the fixed order); for Accelerate, the
DeepSpeed test below (`batches()`, resumed at two ranks) and the in-place ledger
(tests/test_data_ledger_integrations_in_place.py); `batches()` takes either policy's step size from
the sampler's geometry, one code path.
Most of each test's time is the frameworks' imports (several seconds per process on a loaded machine).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.trainer.framework_refs import ORDER_SEED, PER_RANK_BATCH, SAMPLES, expected_ids
from tests.framework_runs import (RESUME_OFFSET, TOTAL, assert_same_optimizer_state, complete_run, ids_by_step,
                                  interrupted_run, optimizer_state, resumed, saved_steps)
from tests.ledger import assert_run, merge, uninterrupted

pytestmark = pytest.mark.slow

DELIVERY = {"hf": "sidecar", "accelerate": "sigterm", "lightning": "sigterm"}
PER_RANK = ("--keep-batch", "rank")


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


def entries(out: Path, world: int) -> list[dict]:
    """One run's records (`ids-<rank>.jsonl`, framework_refs.Records) as ledger entries."""
    return [{**json.loads(line), "rank": rank, "world": world}
            for rank in range(world) for line in (out / f"ids-{rank}.jsonl").read_text().splitlines()]


def fixed_order(worlds: dict[int, int]) -> dict[int, list[int]]:
    """The global batch of each step ({step: world}) in the sampler's fixed order with each rank's
    batch kept: the epochs' permutations end to end (tests/ledger.py's definition, one sample at a
    time), cut into PER_RANK_BATCH x world samples at each step's world."""
    sizes = {step: PER_RANK_BATCH * world for step, world in sorted(worlds.items())}
    stream = [ids[0] for ids in uninterrupted(SAMPLES, ORDER_SEED, 1, sum(sizes.values())).values()]
    batches, at = {}, 0
    for step, size in sizes.items():
        batches[step], at = sorted(stream[at:at + size]), at + size
    return batches


def saved_the_same_step(framework: str, ckpt: Path, out: Path, world: int) -> int:
    """Every rank of the run saved one step, through the one engine and the store's commit, and it is
    the checkpoint the framework's own resume picks; that step."""
    steps = saved_steps(out, world)
    step = steps[0]
    assert steps == [step] * world, steps
    assert newest_step(framework, ckpt) == step
    assert engine_checkpoint(ckpt, step)["step"] == step
    return step


def resumed_with_nothing_lost(saving: Path, resuming: Path, start: int) -> None:
    """The resuming run started at the saved step (0 steps lost) with rank 0's optimizer state equal bit
    for bit to the saving run's at the agreed step."""
    assert resumed(resuming) == {"start": start, "optimizer_steps": [start]}
    assert_same_optimizer_state(optimizer_state(saving, "saved"), optimizer_state(resuming, "resumed"))


@pytest.mark.timeout(2400)  # four runs; minutes only on a loaded machine (imports)
@pytest.mark.parametrize("framework", ["hf", "accelerate", "lightning"])
def test_notice_to_one_rank_same_step_failed_save_84_shrink_and_grow_every_sample_once(framework, tmp_path):
    ckpt = tmp_path / "ckpt"
    first, failing, shrunk, grown = (tmp_path / name for name in ("first", "failing", "shrunk", "grown"))
    offset = RESUME_OFFSET[framework]

    codes, stub, tail = interrupted_run(framework, tmp_path, ckpt, first, DELIVERY[framework], *PER_RANK)
    assert codes == [83, 83], tail
    step = saved_the_same_step(framework, ckpt, first, 2)
    assert step + offset < TOTAL - 3, step
    if stub is not None:  # only rank 1 has a sidecar: it hears that the checkpoint is durable, then drained
        assert [(r["phase"], r["rank"], r["step"]) for r in stub.reports] == [
            ("checkpoint-durable", 1, step), ("drained", 1, step)]

    codes, _stub, tail = interrupted_run(framework, tmp_path, ckpt, failing, "sigterm", "--fail-save", *PER_RANK,
                                         after_step=step + offset + 1)
    assert codes == [84, 84], tail
    assert resumed(failing)["start"] == step + offset
    assert newest_step(framework, ckpt) == step and staged_leftovers(ckpt) == []

    codes, _stub, tail = interrupted_run(framework, tmp_path, ckpt, shrunk, "sigterm", *PER_RANK, world=1,
                                         after_step=step + offset + 3)
    assert codes == [83], tail
    resumed_with_nothing_lost(first, shrunk, step + offset)
    shrunk_at = saved_the_same_step(framework, ckpt, shrunk, 1)

    complete_run(framework, 2, ckpt, grown, *PER_RANK)
    resumed_with_nothing_lost(shrunk, grown, shrunk_at + offset)

    batches, worlds = merge(e for out, world in ((first, 2), (shrunk, 1), (grown, 2)) for e in entries(out, world))
    assert_run(batches, worlds, steps=range(1, TOTAL + 1), world_sizes=[2, 1, 2], samples=SAMPLES,
               same_as=fixed_order(worlds), per_rank=PER_RANK_BATCH)


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
