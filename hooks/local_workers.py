"""The workers of one node, started once and never restarted: the process side of `spotguard launch`.

Contract of `LocalWorkers(workers, shutdown_timeout, *, same_session=False).run()` (in an event loop;
returns the exit status):
- starts one `Worker` after the other, each in its own session (so a terminal's Ctrl-C or a
  signal to the launcher's group reaches a worker once, through the launcher), or with
  `same_session` in a process group of its own inside the launcher's session (the same for
  signals; one scheduling group for the kernel's autogroup: `spotguard launch --same-session`), with
  PR_SET_PDEATHSIG = SIGTERM (a launcher that dies leaves no worker running unwarned; the Guard's
  orphan watch ends a worker that does not leave within its grace);
- on every way out of `run()` (all workers exited, an error, a cancellation) each worker's
  process group gets SIGKILL: nothing a worker started outlives the launcher either;
- SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 sent to the launcher are forwarded, by PID, to every
  worker still running; after SIGTERM or SIGINT no further worker is started;
- a worker that exits is never restarted. One that exits 0, 83 or 84 (finished, or drained
  after a notice) leaves the others running: in place, the survivors go on without it. One that
  crashes (any other status, a signal death included) stops the rest: SIGTERM to each, SIGKILL
  to those still running `shutdown_timeout` seconds later, as torchrun does;
- the result, once every worker has exited (`aggregate_exit`): 0 when all exited 0; 83 when
  every non-zero status is 83; else the first other non-zero status in the order they exited,
  a death by signal N counting as 128+N;
- each start (pid, rank) and each end (status and its meaning) is logged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field

from spotguard.processes import die_with_parent
from spotguard.wire import names

log = logging.getLogger("spotguard.launch")

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEPARTED = (0, names.EXIT_PREEMPTED, names.EXIT_CHECKPOINT_FAILED)  # statuses that leave the others running


@dataclass
class Worker:
    """One local worker: its global rank, its command line and its whole environment."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    status: int | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def kill_group(self) -> None:
        """SIGKILL to the worker's process group (the worker and what it started)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def send(self, sig: int) -> None:
        """Sends `sig` to this worker's PID if it has not been reaped yet."""
        if self.running:
            try:
                self.process.send_signal(sig)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass


def exit_status(returncode: int) -> int:
    """A process's status as a shell reports it: a death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def aggregate_exit(statuses: Iterable[int]) -> int:
    """The launcher's exit status from its workers' statuses in the order they exited (see the module)."""
    failed = [s for s in statuses if s != 0]
    if not failed:
        return 0
    others = [s for s in failed if s != names.EXIT_PREEMPTED]
    return others[0] if others else names.EXIT_PREEMPTED


class LocalWorkers:
    """Starts `workers` once and supervises them until the last has exited (module contract)."""

    def __init__(self, workers: list[Worker], shutdown_timeout: float, *, same_session: bool = False):
        self.workers = workers
        self.shutdown_timeout = shutdown_timeout
        self.same_session = same_session
        self.stopping = False  # SIGTERM/SIGINT received: start nothing more
        self.shutting_down = False  # a worker crashed: the rest are being stopped
        self._kill_timer: asyncio.TimerHandle | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in FORWARDED_SIGNALS:
            loop.add_signal_handler(sig, self._forward, sig)
        try:
            exited: asyncio.Queue[Worker] = asyncio.Queue()
            reapers = [asyncio.ensure_future(self._reap(w, exited)) for w in await self._start_all()]
            statuses = []
            for _ in reapers:
                worker = await exited.get()
                statuses.append(worker.status)
                if worker.status not in DEPARTED and not self.shutting_down:
                    self._shut_down(f"rank {worker.rank} crashed")
            return aggregate_exit(s for s in statuses if s is not None)
        finally:
            for sig in FORWARDED_SIGNALS:
                loop.remove_signal_handler(sig)
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for w in self.workers:  # whatever is left of a worker's process group: nothing outlives the launcher
                w.kill_group()

    async def _start_all(self) -> list[Worker]:
        started = []
        for worker in self.workers:
            if self.stopping or self.shutting_down:
                log.warning("rank %d not started: the launcher is stopping", worker.rank,
                            extra={"rank": worker.rank})
                break
            try:
                worker.process = await asyncio.create_subprocess_exec(
                    *worker.argv, env=worker.env, start_new_session=not self.same_session,
                    process_group=0 if self.same_session else None,
                    preexec_fn=die_with_parent(signal.SIGTERM))
            except OSError as exc:
                log.error("rank %d could not start: %s", worker.rank, exc, extra={"rank": worker.rank})
                worker.status = 1
                started.append(worker)
                break
            log.info("rank %d started (local rank %d, pid %d)", worker.rank, worker.local_rank, worker.process.pid,
                     extra={"rank": worker.rank, "local_rank": worker.local_rank, "pid": worker.process.pid})
            started.append(worker)
        return started

    async def _reap(self, worker: Worker, exited: asyncio.Queue[Worker]) -> None:
        if worker.process is not None:
            returncode = await worker.process.wait()
            worker.status = exit_status(returncode)
            description = names.describe_exit(worker.status)
            if returncode < 0:
                description += f" ({signal.Signals(-returncode).name})"
            log.info("rank %d exited: %s", worker.rank, description,
                     extra={"rank": worker.rank, "pid": worker.process.pid, "status": worker.status,
                            "description": description})
        exited.put_nowait(worker)

    def _forward(self, sig: int) -> None:
        if sig in STOPPING_SIGNALS:
            self.stopping = True
        live = [w for w in self.workers if w.running]
        log.info("forwarding %s to %d worker(s)", signal.Signals(sig).name, len(live),
                 extra={"signal": signal.Signals(sig).name, "ranks": [w.rank for w in live]})
        for w in live:
            w.send(sig)

    def _shut_down(self, reason: str) -> None:
        """SIGTERM to every running worker now, SIGKILL to those left after the shutdown timeout."""
        self.shutting_down = True
        live = [w for w in self.workers if w.running]
        log.warning("%s: stopping %d other worker(s)", reason, len(live),
                    extra={"ranks": [w.rank for w in live], "shutdown_timeout": self.shutdown_timeout})
        for w in live:
            w.send(signal.SIGTERM)
        self._kill_timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._kill_remaining)

    def _kill_remaining(self) -> None:
        live = [w for w in self.workers if w.running]
        if live:
            log.warning("SIGKILL to %d worker(s) still running after %gs", len(live), self.shutdown_timeout,
                        extra={"ranks": [w.rank for w in live]})
        for w in live:
            w.send(signal.SIGKILL)
