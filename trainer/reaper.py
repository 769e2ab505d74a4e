"""Every process a dry-run started, found and ended by a marker in its environment.

The dry-run gives each process it starts (launchers, and through them every worker, joiner and
helper they start) the variable `MARK_ENV=<this run's token>`. A worker that outlived its
launcher (re-parented, in a process group of its own) still carries it, so `reap(token)` finds it where a
process tree or a process group no longer does. Only processes of this user whose environment
carries this run's token are signalled, each by its PID. The local kubelet marks each pod's
processes the same way (`POD_ENV=<pod uid>`) and `kill_marked` ends a pod's processes all at
once, as a container runtime kills a container's cgroup: the workers of a launcher included.
`dump_stacks` asks a pod's processes that catch SIGUSR1 (the reference trainer's `faulthandler`),
but its launcher, for the stacks of their threads first, so a rank found still running at its
node's death says where it was.
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Collection

import psutil

MARK_ENV = "SPOTGUARD_DRYRUN_RUN"
POD_ENV = "SPOTGUARD_DRYRUN_POD"  # a pod's uid, in the environment of each of its processes


def new_token() -> str:
    return secrets.token_hex(8)


def marked(token: str, env_name: str = MARK_ENV) -> list[psutil.Process]:
    """Live (not zombie) processes other than this one whose environment has `env_name=token`.

    Each is a fresh `psutil.Process`, never `process_iter`'s: that one keeps the objects of
    earlier calls, and on a machine whose PIDs wrap (pid_max 32768 here) the kept object of a
    reused PID is the earlier process's: the scan missed the marked process behind it
    (tests/test_reaper.py) and psutil refuses to signal it, so it was never stopped (the likely
    cause of a worker that outlived its container in one CI run)."""
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            proc = psutil.Process(pid)
            if proc.environ().get(env_name) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def reap(token: str, grace: float = 5.0, env_name: str = MARK_ENV) -> list[int]:
    """SIGTERM every marked process, SIGKILL those still alive after `grace` seconds; returns the
    PIDs that were still running (blocking: call it in a thread from async code)."""
    procs = marked(token, env_name)
    for proc in procs:
        _send(proc, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        _send(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace)
    return [p.pid for p in procs]


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT = 0.3  # seconds for the dumps to be written (faulthandler writes from its signal handler)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: /proc/<pid>/status, SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(caught >> (sig - 1) & 1)


def dump_stacks(token: str, env_name: str, skip: Collection[int] = ()) -> list[int]:
    """Sends DUMP_SIGNAL to each process marked `env_name=token` that catches it, but those in
    `skip`, and waits DUMP_WAIT once when any was; the PIDs signalled. A process without a
    handler is left alone (the signal would end it), and so must a launcher be (`skip`: `spotguard
    launch` catches the signal to forward it to every worker, whatever their handlers). Blocking:
    call it in a thread from async code."""
    asked = []
    for proc in marked(token, env_name):
        if proc.pid not in skip and catches(proc.pid, DUMP_SIGNAL):
            _send(proc, DUMP_SIGNAL)
            asked.append(proc.pid)
    if asked:
        time.sleep(DUMP_WAIT)
    return asked


def kill_marked(token: str, env_name: str, rounds: int = 5) -> list[int]:
    """Kills every process whose environment has `env_name=token`, as a container's cgroup is
    killed: each round stops (SIGSTOP) all it finds, so none can fork or outlive its parent
    unseen, then kills them (SIGKILL); it repeats until a round finds none (at most `rounds`).
    Returns the PIDs it killed (blocking: call it in a thread from async code)."""
    killed: list[int] = []
    for _ in range(rounds):
        procs = marked(token, env_name)
        if not procs:
            break
        for proc in procs:
            _send(proc, signal.SIGSTOP)
        for proc in procs:
            _send(proc, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=2.0)
        killed += [p.pid for p in procs]
    return killed
