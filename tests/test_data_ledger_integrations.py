"""The sample ledger of each framework integration on the restart path (trainer/train_hf.py,
train_accelerate.py, train_lightning.py: the reference scripts, DDP on gloo, each rank a plain
subprocess): two ranks, a notice to one (SIGTERM: every rank saves the same step through the
framework's own checkpoint, exit 83), a relaunch at one rank (the shrink, drained the same way),
a relaunch at two (the grow), to the end.

The scripts deal the data with `spotguard.data.ElasticSampler` through the integration
(`sampler=`), keeping each rank's batch (`--keep-batch rank`: 4 samples per rank, so the
global batch is 8, 4, 8 and the steps straddle epochs): every step is trained once, by every rank
of its world, and each epoch sees every sample exactly once (tests/ledger.py). The global batch
kept at every world size is covered by tests/test_integrations_multirank.py (its data order is
the sampler's, `framework_refs.expected_ids`).
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from spotguard.trainer.framework_refs import PER_RANK_BATCH, SAMPLES
from tests.framework_runs import MODULES, TOTAL, args
from tests.ledger import assert_run, merge
from tests.workers.launch import Run, wait_for_progress

pytestmark = pytest.mark.slow


def launch(framework: str, world: int, ckpt: Path, out: Path, *, drain_after: int | None) -> None:
    """`world` ranks; with `drain_after`, once rank 0 finished that global step the last rank alone
    gets SIGTERM and every rank must exit 83; else every rank must finish (0)."""
    extra = ("--keep-batch", "rank", "--step-sleep", "0.05")
    with Run(world, args(ckpt, out, *extra), out / "logs", module=MODULES[framework]) as run:
        if drain_after is None:
            codes, expected = run.wait(600), [0] * world
        else:
            wait_for_progress(out, 0, drain_after, timeout=600, procs=run.procs)
            run.procs[-1].send_signal(signal.SIGTERM)
            codes, expected = run.wait(300), [83] * world
        assert codes == expected, run.tail()


def entries(out: Path, world: int) -> list[dict]:
    """One launch's records (`ids-<rank>.jsonl`, framework_refs.Records) as ledger entries."""
    return [{**json.loads(line), "rank": rank, "world": world}
            for rank in range(world) for line in (out / f"ids-{rank}.jsonl").read_text().splitlines()]


def last_step(out: Path) -> int:
    return int((out / "progress-0").read_text())


@pytest.mark.timeout(1800)  # three launches; minutes only on a loaded machine (the frameworks' imports)
@pytest.mark.parametrize("framework", ["hf", "accelerate", "lightning"])
def test_every_sample_once_per_epoch_through_a_shrink_and_a_grow(framework, tmp_path):
    ckpt = tmp_path / "ckpt"
    launches = [(2, tmp_path / "two"), (1, tmp_path / "one"), (2, tmp_path / "two-again")]
    launch(framework, 2, ckpt, launches[0][1], drain_after=3)
    launch(framework, 1, ckpt, launches[1][1], drain_after=last_step(launches[0][1]) + 3)
    launch(framework, 2, ckpt, launches[2][1], drain_after=None)

    batches, worlds = merge(e for world, out in launches for e in entries(out, world))
    assert_run(batches, worlds, steps=range(1, TOTAL + 1), world_sizes=[2, 1, 2], samples=SAMPLES,
               per_rank=PER_RANK_BATCH)
