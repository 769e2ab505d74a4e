"""Running tests/workers/elastic.py as one process per host, for the in-place membership tests.

`Hosts(out, mode, ckpt)` (a context manager) starts hosts by name: `start(["a", "b", "c"])` makes
them ranks 0.. of a job on host "a"'s store (in place: `SPOTGUARD_IN_PLACE=1`, each host serving
its own rendezvous port), `join("d")` starts a joiner, `push(generation, hosts)` writes the
membership the workers read (what a sidecar would relay; its store is the first host's port).
Each host's rank writes its termination message to `termination-<host>` (`termination(host)`).
`launched=True` starts each host through `spotguard launch` (the procs are then the launchers; the
workers' pids are in `pid-<host>`); `worker=` replaces the worker's argv (after the interpreter).
Every process is killed by PID in `close()` (launched workers too); every wait has a timeout. `restart(...)` is the
relaunch that today's path makes: a fresh job of plain `init_process_group` ranks resuming from a
checkpoint directory; it returns the state it loaded.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

from spotguard.hooks.adapters.store import CheckpointStore
from spotguard.hooks.checkpoint.dcp import StoreDcpReader
from spotguard.processes import free_port
from tests.workers.state_dump import flatten
from tests.workers import zygote
from tests.workers.launch import ROOT, base_env, kill_all, load_state

ELASTIC = Path(__file__).resolve().parent / "elastic.py"


class Hosts:
    """See the module docstring."""

    def __init__(self, out: Path, mode: str, ckpt: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 in_place: bool = True, launched: bool = False, worker: list[str] | None = None):
        self.out, self.mode, self.ckpt = out, mode, ckpt
        self.args = ["--mode", mode, "--ckpt", str(ckpt), "--out", str(out), *args]
        self.worker = worker if worker is not None else [str(ELASTIC), *self.args]
        self.launched = launched
        self.env = dict(env or {})
        self.in_place = in_place
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)

    def port(self, host: str) -> int:
        if host not in self.ports:
            self.ports[host] = free_port()
        return self.ports[host]

    def _env(self, host: str, extra: dict[str, str]) -> dict[str, str]:
        env = base_env()
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", SPOTGUARD_NODE=host, SPOTGUARD_RDZV_HOST="127.0.0.1",
                   SPOTGUARD_RDZV_PORT=str(self.port(host)),
                   SPOTGUARD_TERMINATION_LOG=str(self.out / f"termination-{host}"))
        if self.in_place:
            env["SPOTGUARD_IN_PLACE"] = "1"
        env.update(self.env)
        env.update(extra)
        return env

    def _spawn(self, host: str, env: dict[str, str], args: tuple[str, ...]) -> None:
        argv = [*self.worker, *args]
        if self.launched:
            argv = ["-m", "spotguard", "launch", "--nnodes", env.get("WORLD_SIZE", "1"),
                    "--node-rank", env.get("RANK", "0"), "--master-port", env.get("MASTER_PORT", str(self.port(host))),
                    *argv]
        with open(self.out / f"log-{host}", "wb") as log:
            self.procs[host] = zygote.popen(argv, env=env, cwd=ROOT, stdout=log)

    def start(self, hosts: list[str], args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """`hosts` as ranks 0.. of a new job, on the first host's store."""
        master = str(self.port(hosts[0]))
        for rank, host in enumerate(hosts):
            extra = dict(RANK=str(rank), WORLD_SIZE=str(len(hosts)), MASTER_PORT=master, **(env or {}))
            self._spawn(host, self._env(host, extra), args)

    def join(self, host: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """A joiner on `host`: it says it is ready in `ready-<host>` and waits for a membership."""
        extra = dict(SPOTGUARD_JOIN="1", SPOTGUARD_READY_FILE=str(self.out / f"ready-{host}"), **(env or {}))
        self._spawn(host, self._env(host, extra), args)

    def push(self, generation: int, hosts: list[str], start: bool = False, standby: bool = False,
             first: tuple[int, list[str]] | None = None, to: str = "membership.json") -> None:
        """The membership `hosts` (generation `generation`), led by the first host's store;
        `start`: the job's first group (start at min); `standby`: warm standby (the replacement hold);
        `first`: (generation, hosts) of the `start` membership it descends from; `to`: the file
        (a worker reads the one its TEST_MEMBERSHIP_FILE names, else membership.json)."""
        data = self.membership(generation, hosts, start, standby)
        if first is not None:
            data["first"] = self.membership(first[0], first[1], start=True)
        tmp = self.out / f"{to}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out / to)

    def membership(self, generation: int, hosts: list[str], start: bool = False, standby: bool = False) -> dict:
        return {"v": 1, "generation": generation, "hosts": hosts, "world_size": len(hosts),
                "store": f"127.0.0.1:{self.port(hosts[0])}", **({"start": True} if start else {}),
                **({"standby": True} if standby else {})}

    # ---- what the hosts left behind -------------------------------------------------------------
    def wait_for(self, name: str, timeout: float = 120) -> Path:
        """The file `name` under out, once it exists (AssertionError with the logs after `timeout`)."""
        path = self.out / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not written in {timeout}s:\n{self.tail()}")
            time.sleep(0.05)
        return path

    def wait_until(self, check, what: str, timeout: float = 240) -> None:
        """Returns once `check()` holds (AssertionError with the logs after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.tail()}")
            time.sleep(0.05)

    def wait_step(self, host: str, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.progress(host) < step:
            if time.monotonic() > deadline or self.procs[host].poll() is not None:
                raise AssertionError(f"{host} did not reach step {step}:\n{self.tail()}")
            time.sleep(0.05)

    def progress(self, host: str) -> int:
        try:
            return int((self.out / f"progress-{host}").read_text() or -1)
        except (OSError, ValueError):
            return -1

    def wait(self, hosts: list[str], timeout: float = 60) -> dict[str, int]:
        """Exit codes of `hosts`' processes."""
        deadline = time.monotonic() + timeout
        codes = {}
        for host in hosts:
            try:
                codes[host] = self.procs[host].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{host} did not finish in {timeout}s:\n{self.tail()}") from None
        return codes

    def pid(self, host: str) -> int:
        return int((self.out / f"pid-{host}").read_text())

    def termination(self, host: str) -> dict | None:
        """The termination message the host's rank wrote as it left (None: it wrote none)."""
        path = self.out / f"termination-{host}"
        return json.loads(path.read_text()) if path.exists() else None

    def changes(self, host: str) -> list[dict]:
        path = self.out / f"resize-{host}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def state(self, tag: str) -> dict[str, torch.Tensor]:
        return load_state(self.out / f"state-{tag}.pt")

    def log(self, host: str) -> str:
        """What `host`'s process wrote so far ("" before it wrote anything)."""
        path = self.out / f"log-{host}"
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {host}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                         for host in self.procs if (path := self.out / f"log-{host}").exists())

    def close(self) -> None:
        kill_all(self.procs.values())
        if self.launched:
            for host in self.procs:
                try:
                    os.kill(self.pid(host), 9)
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checkpoint_steps(ckpt: Path) -> list[int | None]:
    """The steps of the complete checkpoints in `ckpt`, oldest first."""
    return [info.step for info in CheckpointStore(ckpt).list()]


def newest_checkpoint(ckpt: Path) -> tuple[int | None, dict[str, torch.Tensor]]:
    """The newest complete checkpoint in `ckpt` read in this process (no process group, the
    store's own DCP reader): its step, and its state as flat tensors like the workers' dumps."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    store = CheckpointStore(ckpt)
    info = store.latest()
    assert info is not None, f"no complete checkpoint in {ckpt}"
    state: dict = {}
    _load_state_dict(state, storage_reader=StoreDcpReader(info.dir), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return info.step, flatten(state["model"], state["optim"])


def restart(mode: str, ckpt: Path, out: Path, world: int, steps: int) -> dict[str, torch.Tensor]:
    """Today's relaunch: `world` fresh ranks resume from `ckpt` and stop at `steps` (the resume step:
    they train nothing); the state they loaded (`state-resume.pt`)."""
    with Hosts(out, mode, ckpt, ("--steps", str(steps)), in_place=False) as fresh:
        hosts = [f"r{rank}" for rank in range(world)]
        fresh.start(hosts)
        codes = fresh.wait(hosts, timeout=240)
        assert set(codes.values()) == {0}, fresh.tail()
        return fresh.state("resume")
