"""Launches one generation of the training job: one torchrun per simulated node.

A generation is the job at one fixed world size. Each node runs
`torchrun --nnodes=W --node-rank=i --nproc-per-node=1` with its own environment (its sidecar's
URL and token file, its event log), in a process group of its own so the node can be stopped:
gracefully (SIGTERM, as a drain would) or abruptly (SIGKILL, as a reclaim at the deadline does:
to the node's torchrun or launcher; an in-place worker, in a group of its own, then gets its
launcher's parent-death SIGTERM). Only processes started here are ever signalled, by their
process group. The groups stay in this process's session, and an in-place node's launcher keeps
its workers in it too (`spotguard launch --same-session`, whose docstring says why: the nodes
share one host). torchrun's own workers (the restart path) get sessions of their own.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.processes import die_with_parent, free_port


@dataclass
class NodeLaunch:
    """What one node's torchrun needs: its name and the environment of its pod."""

    node: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RunningNode:
    node: str
    process: asyncio.subprocess.Process
    log_path: Path
    exit_code: int | None = None
    ended_at: float | None = None
    killed: bool = False
    started_at: float = 0.0


class Generation:
    """The job at one world size. `start()`, then `wait()` until every node's torchrun ends."""

    def __init__(self, index: int, nodes: list[NodeLaunch], train_argv: list[str], run_dir: Path,
                 extra_env: dict[str, str] | None = None, rdzv_ports: dict[str, int] | None = None,
                 min_world_size: int = 1, start_at_min: bool = False):
        """`rdzv_ports` (node -> port): launch with `spotguard launch` for in-place membership
        changes (every node's store on its own port of 127.0.0.1) instead of torchrun.
        `start_at_min`: `--nnodes MIN:MAX` with each node's ready file (`ready_files`, node ->
        path): the workers wait for the first membership, which the dry-run pushes."""
        self.index = index
        self.nodes = nodes
        self.rdzv_ports = rdzv_ports
        self.min_world_size = min_world_size
        self.start_at_min = start_at_min
        self.ready_files: dict[str, Path] = {}
        self.train_argv = train_argv
        self.run_dir = run_dir
        self.extra_env = extra_env or {}
        self.running: dict[str, RunningNode] = {}
        self.launched_at = 0.0

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    async def start(self) -> None:
        port = free_port()
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.launched_at = time.time()
        for rank, launch in enumerate(self.nodes):
            env = self._env(launch)
            if self.rdzv_ports is None:
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.world_size}",
                       f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                       f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.1",
                       *self.train_argv]
            else:
                cmd = self._in_place_command(launch.node, rank, self.world_size, self.ready_files.get(launch.node),
                                             join=False)
            await self._spawn(launch.node, cmd, env)

    def _in_place_command(self, node: str, rank: int, world_size: int, ready_file: Path | None = None,
                          join: bool = True) -> list[str]:
        assert self.rdzv_ports is not None
        first = self.nodes[0].node
        nnodes = f"{self.min_world_size}:{world_size}" if self.start_at_min and not join else str(world_size)
        cmd = [sys.executable, "-m", "spotguard", "launch", f"--nnodes={nnodes}", f"--node-rank={rank}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={self.rdzv_ports[first]}",
               f"--node-name={node}", "--rdzv-host=127.0.0.1", f"--rdzv-port={self.rdzv_ports[node]}",
               "--reform-timeout=10", f"--min-world-size={self.min_world_size}", "--same-session"]
        if ready_file is not None:
            cmd += ["--join", f"--ready-file={ready_file}"] if join else [f"--ready-file={ready_file}"]
        return cmd + self.train_argv

    async def _spawn(self, node: str, cmd: list[str], env: dict[str, str]) -> None:
        log_path = self.run_dir / "logs" / f"gen{self.index}-{node}.log"
        log = await asyncio.to_thread(open, log_path, "ab")
        with log:
            process = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=log,
                                                           stderr=asyncio.subprocess.STDOUT,
                                                           stdin=asyncio.subprocess.DEVNULL, process_group=0,
                                                           preexec_fn=die_with_parent(signal.SIGTERM))
        self.running[node] = RunningNode(node, process, log_path, started_at=time.time())

    async def add_joiner(self, launch: NodeLaunch, ready_file: Path) -> None:
        """Starts a worker on `launch.node` that joins the running job in place once a membership
        lists it (it creates `ready_file` when it is ready to)."""
        await self._spawn(launch.node, self._in_place_command(launch.node, 0, 1, ready_file), self._env(launch))

    def _env(self, launch: NodeLaunch) -> dict[str, str]:
        """A node's environment: the pod's (its sidecar, token, event log) over this process's."""
        return {**os.environ, **self.extra_env, **launch.env,
                "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONUNBUFFERED": "1", "SPOTGUARD_GENERATION": str(self.index), "SPOTGUARD_NODE": launch.node,
                "TORCHELASTIC_SHUTDOWN_TIMEOUT": "60"}

    async def wait(self) -> dict[str, int]:
        """Waits for every node's torchrun; returns node -> exit code."""
        await asyncio.gather(*(self._reap(r) for r in self.running.values()))
        return {n: r.exit_code for n, r in self.running.items()}

    async def _reap(self, r: RunningNode) -> None:
        r.exit_code = await r.process.wait()
        r.ended_at = time.time()

    @property
    def done(self) -> bool:
        """True once every node's torchrun has exited (exit codes are then in `running`)."""
        for r in self.running.values():
            if r.exit_code is None and r.process.returncode is not None:
                r.exit_code, r.ended_at = r.process.returncode, time.time()
        return all(r.exit_code is not None for r in self.running.values())

    def signal_node(self, node: str, sig: int) -> None:
        """Sends `sig` to the node's process group (its torchrun or launcher, which forwards it)."""
        r = self.running.get(node)
        if r is None or r.process.returncode is not None:
            return
        try:
            os.killpg(r.process.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGKILL:
            r.killed = True

    def signal_all(self, sig: int) -> None:
        for node in list(self.running):
            self.signal_node(node, sig)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every node, then SIGKILL whatever is left after `grace` seconds."""
        self.signal_all(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.wait(), grace)
        except TimeoutError:
            self.signal_all(signal.SIGKILL)
            await self.wait()
