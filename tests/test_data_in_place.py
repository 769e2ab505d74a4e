"""The sample ledger of the reference trainer through membership changes IN PLACE (real gloo
processes, one per host, tests/workers/hosts.py): a, b, c train; a gets SIGTERM and leaves (83)
while b and c re-form a group of two in the same processes; then the joiner d, started early and
waiting, is admitted (membership b, c, d, from the stand-in sidecar) and receives the state, the data position included,
from a live peer (the extras the transfer carries); everyone trains to the end.

No process restarts and no loader is rebuilt: the survivors' ElasticSampler re-shards the
remainder at the change (a new iterator of the same DataLoader), the joiner's starts at the
survivors' position. Every step is trained once, by every rank of its world; each epoch sees every
sample exactly once; with the global batch kept the global batches are an uninterrupted run's.
"""
from __future__ import annotations

import signal

import pytest

from tests.ledger import assert_run, read_ledgers_with_worlds, uninterrupted, worlds_so_far
from tests.workers.hosts import Hosts
from tests.workers.sidecar_stub import SidecarStub

pytestmark = pytest.mark.slow

# 60 steps of 12 samples: 7 1/5 epochs. The shrink and the grow come by step ~10 (the test waits on
# them); the ~50 steps after (10 s and more at 0.2 s a step) are the margin before training could
# end first. The margin is seconds of synthetic compute (a sleep: no CPU), not steps: it was 200
# steps at 0.05 s, the same 10 s, and every epoch's end forks each rank's loader workers anew
# (~0.1 s of CPU a worker), which the 140 more steps paid ~17 times over without proving more (the
# epochs after the changes are the same code at the same world).
SAMPLES, GLOBAL, MICRO, STEPS, SEED, STEP_SECONDS = 100, 12, 4, 60, 7, 0.2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, workers, policy", [("ddp", 2, "keep-global"), ("fsdp2", 0, "scale-lr")])
def test_every_sample_once_per_epoch_through_an_in_place_shrink_and_grow(mode, workers, policy, tmp_path):
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    trainer = ["-m", "spotguard.trainer.train", "--framework", mode, "--steps", str(STEPS), "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--samples", str(SAMPLES), "--global-batch", str(GLOBAL), "--micro-batch",
               str(MICRO), "--batch-policy", policy, "--base-world-size", "3", "--data-workers", str(workers),
               "--ledger", str(ledger), "--seed", str(SEED), "--step-seconds", str(STEP_SECONDS)]
    with SidecarStub() as sidecar, Hosts(tmp_path / "run", mode, tmp_path / "ckpt", worker=trainer,
                                         env={"SPOTGUARD_SIDECAR_URL": sidecar.url,
                                              "SPOTGUARD_REFORM_TIMEOUT": "20"}) as hosts:
        hosts.start(["a", "b", "c"])
        hosts.join("d")
        pids = {host: proc.pid for host, proc in hosts.procs.items()}
        hosts.wait_for("ready-d", timeout=240)
        hosts.wait_until(lambda: len(worlds_so_far(ledger)) >= 5, "a, b, c training")
        hosts.procs["a"].send_signal(signal.SIGTERM)
        assert hosts.wait(["a"], timeout=240) == {"a": 83}, hosts.tail()
        hosts.wait_until(lambda: sum(w == 2 for w in worlds_so_far(ledger).values()) >= 3, "b and c training as two")
        sidecar.push_membership({"v": 1, "generation": 1, "hosts": ["b", "c", "d"], "world_size": 3,
                                 "store": f"127.0.0.1:{hosts.port('b')}"})
        codes = hosts.wait(["b", "c", "d"], timeout=600)
        assert codes == {"b": 0, "c": 0, "d": 0}, hosts.tail()
        assert {h: hosts.procs[h].pid for h in "bcd"} == {h: pids[h] for h in "bcd"}  # nobody relaunched

    batches, worlds = read_ledgers_with_worlds(ledger)
    kept = {"same_as": uninterrupted(SAMPLES, SEED, GLOBAL, STEPS)} if policy == "keep-global" else {"per_rank": 4}
    assert_run(batches, worlds, steps=range(STEPS), world_sizes=[3, 2, 3], samples=SAMPLES, **kept)
