"""Runs of the framework reference scripts (trainer/train_{hf,accelerate,lightning}.py) for the
integration tests: DDP on gloo, each rank a plain subprocess, one notice delivered to one rank
(SIGTERM to that rank's process, or the stand-in sidecar that only that rank connects to).
The bounds are generous: one process imports a framework in 3-5 s on a quiet machine, and in
over a minute on this 2-core machine when other jobs load it."""
from __future__ import annotations

import json
import signal
from datetime import timedelta
from pathlib import Path

import torch

from spotguard.wire.notice import Notice, now_utc
from tests.workers.launch import Run, run_ranks, wait_for_progress
from tests.workers.sidecar_stub import SidecarStub

TOTAL = 16  # steps of every run; resumed runs end at the same step
MODULES = {"hf": "spotguard.trainer.train_hf", "accelerate": "spotguard.trainer.train_accelerate",
           "lightning": "spotguard.trainer.train_lightning"}
# The Guard's step at the agreed boundary vs. the steps done at resume: the Trainer and Lightning
# count global steps (the step done), the Accelerate helper uses the loop's index (resume at index + 1).
RESUME_OFFSET = {"hf": 0, "accelerate": 1, "lightning": 0}


def args(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["--ckpt", str(ckpt), "--out", str(out), "--steps", str(TOTAL), *extra]


def complete_run(framework: str, world: int, ckpt: Path, out: Path, *extra: str) -> None:
    codes, tail = run_ranks(world, args(ckpt, out, *extra), out / "logs", timeout=600, module=MODULES[framework])
    assert codes == [0] * world, tail


def notice(nid: str) -> dict:
    now = now_utc()
    return Notice(id=nid, kind="reclaim", source="aws.spot", node="n1", detected_at=now,
                  deadline=now + timedelta(seconds=120)).to_wire()


def interrupted_run(framework: str, tmp_path: Path, ckpt: Path, out: Path, delivery: str, *extra: str,
                    after_step: int = 3, world: int = 2) -> tuple[list[int], SidecarStub | None, str]:
    """`world` ranks; once rank 0 passed `after_step`, the last rank alone gets the notice. (exit codes,
    stub, log tail)."""
    stub = SidecarStub() if delivery == "sidecar" else None
    rank_env = {}
    if stub is not None:
        stub.__enter__()
        token = tmp_path / "token"
        token.write_text(stub.token)
        rank_env = {world - 1: {"SPOTGUARD_SIDECAR_URL": stub.url, "SPOTGUARD_TOKEN_FILE": str(token)}}
    try:
        with Run(world, args(ckpt, out, "--step-sleep", "0.05", *extra), out / "logs", rank_env=rank_env,
                 module=MODULES[framework]) as run:
            wait_for_progress(out, 0, after_step, timeout=600, procs=run.procs)
            if stub is None:
                run.procs[-1].send_signal(signal.SIGTERM)
            else:
                stub.wait_for_connection(run.procs)
                stub.push("notice", notice(f"aws.spot:{framework}"))
            return run.wait(300), stub, run.tail()
    finally:
        if stub is not None:
            stub.__exit__(None, None, None)


def saved_steps(out: Path, world: int) -> list[int]:
    return [json.loads((out / f"saved-{r}.json").read_text())["step"] for r in range(world)]


def resumed(out: Path) -> dict:
    return json.loads((out / "resumed-0.json").read_text())


def ids_by_step(out: Path, world: int) -> dict[int, list[int]]:
    """The global batch of each step: the sample ids every rank trained on, by global step."""
    steps: dict[int, list[int]] = {}
    for r in range(world):
        for line in (out / f"ids-{r}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["ids"])
    return {s: sorted(v) for s, v in steps.items()}


def optimizer_state(out: Path, when: str) -> dict:
    return torch.load(out / f"optimizer-{when}.pt", weights_only=True)


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    """Bit-exact equality of two optimizer `state` dicts (moments and step counts)."""
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for key in a:
        assert sorted(a[key]) == sorted(b[key])
        for name, value in a[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key][name])), (key, name)
