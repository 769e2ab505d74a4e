"""The sample ledger of the reference trainer (trainer/train.py) on the restart path: real gloo
ranks, every change of world size a relaunch of every rank from the checkpoint the Guard wrote at
the agreed step (a notice to one rank: SIGTERM; every rank drains with 83).

Each rank records the sample ids of every step it trains (`--ledger`). Through a shrink (2 -> 1)
and a grow (1 -> 3), mid-epoch, with DDP and FSDP2, loaders with 0 and 2 workers:
- every step is trained exactly once, by every rank of its world;
- each epoch sees every sample exactly once (tests/ledger.py: at every step boundary no sample
  is seen a second time before every other one was seen once);
- with the global batch kept (`--batch-policy keep-global`: gradient accumulation), the global
  batch of every step is the one an uninterrupted run takes, as tests/ledger.py computes it from
  the definition, independently of spotguard's code; with each rank's batch kept (`scale-lr`) the
  global batch follows the world size (6 samples per rank).
The keep-global run's first launch trains 9 steps at two ranks before its notice: an
uninterrupted real run across an epoch's end (an epoch is 8 1/3 steps), checked against the
definition with the rest.

Two runs, not one per combination: the data path (the sampler, the loader, the position in the
checkpoint's extras) is the same code under DDP and FSDP2 (one TorchDCPAdapter, `data=sampler`;
only the model's layout differs), and the batch policy only sets the sampler's geometry, so each
framework runs once, with one policy each. What does interact with the policy is the loader's
workers (a worker prefetches micro-batches that the saved position must not count): the worker
count changes at each relaunch (it is not part of the position), so each policy drains once with
0 workers and once with 2, under a different framework each time.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.ledger import assert_run, read_ledgers_with_worlds, uninterrupted
from tests.workers.launch import Run

pytestmark = pytest.mark.slow

TRAIN = "spotguard.trainer.train"
SAMPLES, GLOBAL, MICRO, TOTAL, SEED = 100, 12, 4, 36, 7  # an epoch is 8 1/3 steps: batches straddle epochs


def trainer_args(ckpt: Path, ledger: Path, framework: str, workers: int, policy: str) -> list[str]:
    return ["--framework", framework, "--checkpoint-dir", str(ckpt), "--steps", str(TOTAL), "--samples", str(SAMPLES),
            "--global-batch", str(GLOBAL), "--micro-batch", str(MICRO), "--batch-policy", policy,
            "--base-world-size", "2", "--data-workers", str(workers), "--ledger", str(ledger), "--seed", str(SEED),
            "--step-seconds", "0.05"]


def recorded(ledger: Path, pid: int) -> int:
    path = ledger / f"ledger-{pid}.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def drained_launch(world: int, args: list[str], logs: Path, ledger: Path, after: int = 5) -> None:
    """`world` ranks; once rank 0 trained `after` steps in this launch, the last rank alone gets
    SIGTERM: every rank checkpoints the agreed step and exits 83."""
    with Run(world, args, logs, module=TRAIN) as run:
        deadline = time.monotonic() + 300
        while recorded(ledger, run.procs[0].pid) < after:
            assert time.monotonic() < deadline, f"rank 0 did not train {after} steps:\n{run.tail()}"
            assert all(p.poll() is None for p in run.procs), f"a rank exited early:\n{run.tail()}"
            time.sleep(0.05)
        run.procs[-1].send_signal(signal.SIGTERM)
        codes = run.wait(300)
        assert codes == [83] * world, run.tail()


def complete_launch(world: int, args: list[str], logs: Path) -> None:
    with Run(world, args, logs, module=TRAIN) as run:
        codes = run.wait(600)
        assert codes == [0] * world, run.tail()


# (framework, policy, the loader's workers at each launch: two ranks, one, three); the first
# drain's step (keep-global: past the first epoch's end, 8 1/3 steps, in one uninterrupted launch)
RUNS = [("ddp", "keep-global", (2, 0, 2), 9), ("fsdp2", "scale-lr", (0, 2, 0), 5)]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("framework, policy, workers, first_drain", RUNS, ids=["ddp-keep-global", "fsdp2-scale-lr"])
def test_every_sample_once_per_epoch_through_a_shrink_and_a_grow_on_the_restart_path(framework, policy, workers,
                                                                                     first_drain, tmp_path):
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger"
    ledger.mkdir()
    two, one, three = (trainer_args(ckpt, ledger, framework, w, policy) for w in workers)
    drained_launch(2, two, tmp_path / "logs-2", ledger, after=first_drain)
    drained_launch(1, one, tmp_path / "logs-1", ledger)  # the shrink: a relaunch at one rank
    complete_launch(3, three, tmp_path / "logs-3")  # the grow: a relaunch at three ranks

    batches, worlds = read_ledgers_with_worlds(ledger)
    kept = {"same_as": uninterrupted(SAMPLES, SEED, GLOBAL, TOTAL)} if policy == "keep-global" else {"per_rank": 6}
    assert_run(batches, worlds, steps=range(TOTAL), world_sizes=[2, 1, 3], samples=SAMPLES, **kept)
