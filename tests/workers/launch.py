"""Starting and stopping multi-process training runs for the tests (plain subprocesses or torchrun).

Every process started here is killed by PID in `Run.close()` (used as a context manager),
with a timeout on every wait.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

from spotguard.processes import free_port
from tests.workers import zygote

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "trainer.py"


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    return env


class Run:
    """`world` ranks of tests/workers/trainer.py (or of `-m module`) as plain subprocesses (one exit code each)."""

    def __init__(self, world: int, args: list[str], log_dir: Path, rank_env: dict[int, dict[str, str]] | None = None,
                 module: str | None = None):
        self.world = world
        self.procs: list[subprocess.Popen] = []
        self.logs = [log_dir / f"rank{r}.log" for r in range(world)]
        log_dir.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        program = ["-m", module] if module else [str(TRAINER)]
        for rank in range(world):
            env = base_env()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_PORT=port)
            env.update((rank_env or {}).get(rank, {}))
            with open(self.logs[rank], "wb") as log:
                self.procs.append(zygote.popen([*program, *args], env=env, cwd=ROOT, stdout=log))

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"ranks did not finish in {timeout}s:\n{self.tail()}") from None
        return codes

    def tail(self, lines: int = 25) -> str:
        return "\n".join(f"--- rank {r}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for r, p in enumerate(self.logs) if p.exists())

    def close(self) -> None:
        kill_all(self.procs)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kill_all(procs) -> None:
    """Kills every process of `procs` still running, by PID, and reaps it (10 s at most each)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def run_ranks(world: int, args: list[str], log_dir: Path, timeout: float = 120, **kwargs) -> tuple[list[int], str]:
    with Run(world, args, log_dir, **kwargs) as run:
        codes = run.wait(timeout)
        return codes, run.tail()


def wait_for_progress(out: Path, rank: int, step: int, timeout: float = 240, procs=()) -> None:
    """Until rank `rank` finished step `step`; raises AssertionError when one of `procs` exited
    first or after `timeout` (only a loaded machine takes minutes to import torch and start)."""
    deadline = time.monotonic() + timeout
    path = out / f"progress-{rank}"
    while time.monotonic() < deadline:
        try:
            if int(path.read_text() or -1) >= step:
                return
        except (OSError, ValueError):
            pass
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank exited before reaching the step")
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout}s")


def saved(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"saved-{r}.json").read_text()) for r in range(world)]


def exits(out: Path, world: int) -> list[int]:
    return [int((out / f"exit-{r}").read_text()) for r in range(world)]


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two full-state dumps (parameters and optimizer moments)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"
    assert any(k.startswith("exp_avg") for k in a), "optimizer state missing from the dump"
