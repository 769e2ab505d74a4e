"""The sample ledger of a framework integration through membership changes IN PLACE: the reference
Accelerate script (trainer/train_accelerate.py, its in-place form: `AccelerateGuard(in_place=True)`,
`guard.steps`), DDP on gloo, one process per host (tests/workers/hosts.py), the stand-in sidecar
relaying the membership.

The joiner c starts first and waits (imports done) until a membership admits it; a and b train at
two; a gets SIGTERM and leaves (83) while b trains on alone in the same process (the shrink, 2 -> 1:
the gradient accumulation goes from 1 to 2 micro-batches of 4, the global batch stays 8); then the
membership [b, c] admits c, which receives the state from b (the grow, 1 -> 2); both train to the end.
One run checks together:
- the ledger: every step trained once, by every rank of its world; worlds 2 -> 1 -> 2; each epoch
  every sample exactly once, and the global batches are an uninterrupted run's (tests/ledger.py);
- the pids: b's one process trained at 2, 1 and 2 (its ledger file, named by its pid, holds all
  three), c's only after the grow: nobody relaunched;
- the resume: after the grow b and c hold the same model and optimizer state after every step (a
  digest of both, in each ledger line): the joiner received the parameters, the optimizer state,
  the scheduler's and the sampler's state; a and b agree likewise before the shrink. The newest
  checkpoint, the grow's (b alone wrote it, rank 0 of a group of one after the shrink: it holds the
  model only if Accelerate learnt b's new rank), is an ordinary `save_state` directory holding
  exactly the state b trained with at that step and the sampler's position after it.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.trainer.framework_refs import GLOBAL_BATCH, ORDER_SEED, SAMPLES
from spotguard.trainer.model import state_digest
from tests.ledger import assert_run, read_ledgers_with_worlds, uninterrupted, worlds_so_far
from tests.workers.hosts import Hosts
from tests.workers.sidecar_stub import SidecarStub

pytestmark = pytest.mark.slow

STEPS = 80  # 10 epochs of 8 steps; the shrink and the grow come by step ~15 (the test waits on them)


def ledger_of(ledger: Path, pid: int) -> list[dict]:
    path = ledger / f"ledger-{pid}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained_at(ledger: Path, world: int, after: int = -1) -> int:
    """Steps after `after` recorded at `world` so far."""
    return sum(w == world for s, w in worlds_so_far(ledger).items() if s > after)


@pytest.mark.timeout(600)
def test_accelerate_in_place_every_sample_once_through_a_shrink_and_a_grow(tmp_path):
    ledger, out = tmp_path / "ledger", tmp_path / "run"
    ledger.mkdir()
    script = ["-m", "spotguard.trainer.train_accelerate", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out),
              "--steps", str(STEPS), "--micro-batch", "4", "--step-sleep", "0.05", "--ledger", str(ledger)]
    with SidecarStub() as sidecar, Hosts(out, "ddp", tmp_path / "ckpt", worker=script,
                                         env={"SPOTGUARD_SIDECAR_URL": sidecar.url,
                                              "SPOTGUARD_REFORM_TIMEOUT": "30"}) as hosts:
        hosts.join("c")  # first: its imports are done before a and b train
        hosts.wait_for("ready-c", timeout=240)
        hosts.start(["a", "b"])
        pids = {host: proc.pid for host, proc in hosts.procs.items()}
        hosts.wait_until(lambda: trained_at(ledger, 2) >= 3, "a and b training as two")
        hosts.procs["a"].send_signal(signal.SIGTERM)
        assert hosts.wait(["a"], timeout=240) == {"a": 83}, hosts.tail()
        hosts.wait_until(lambda: trained_at(ledger, 1) >= 3, "b training alone")
        shrunk = max(s for s, w in worlds_so_far(ledger).items() if w == 1)
        sidecar.push_membership({"v": 1, "generation": 1, "hosts": ["b", "c"], "world_size": 2,
                                 "store": f"127.0.0.1:{hosts.port('b')}"})
        assert hosts.wait(["b", "c"], timeout=400) == {"b": 0, "c": 0}, hosts.tail()
        assert trained_at(ledger, 2, after=shrunk) > 0, "the grow came after the last step"

    batches, worlds = read_ledgers_with_worlds(ledger)
    assert_run(batches, worlds, steps=range(STEPS), world_sizes=[2, 1, 2], samples=SAMPLES,
               same_as=uninterrupted(SAMPLES, ORDER_SEED, GLOBAL_BATCH, STEPS))
    survivor, joiner = ledger_of(ledger, pids["b"]), ledger_of(ledger, pids["c"])
    worlds_b = [e["world"] for e in survivor]
    assert [w for i, w in enumerate(worlds_b) if i == 0 or w != worlds_b[i - 1]] == [2, 1, 2]  # one process
    assert joiner and {e["world"] for e in joiner} == {2} and joiner[0]["step"] > shrunk
    digests: dict[int, set[str]] = {}
    for entry in [*ledger_of(ledger, pids["a"]), *survivor, *joiner]:
        digests.setdefault(entry["step"], set()).add(entry["digest"])
    assert all(len(d) == 1 for d in digests.values()), {s: d for s, d in digests.items() if len(d) > 1}
    info = CheckpointStore(tmp_path / "ckpt").resolve(verify=True)
    assert info is not None and info.metadata["reason"] == "membership" and info.metadata["world_size"] == 1, info
    saved = state_digest(load_file(info.dir / "model.safetensors"),
                         torch.load(info.dir / "optimizer.bin", weights_only=True)["state"])
    assert digests[info.step] == {saved}
    assert torch.load(info.dir / "custom_checkpoint_0.pkl", weights_only=True)["steps"] == info.step + 1
