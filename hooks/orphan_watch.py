"""A worker never outlives its launcher, even when it is blocked where no signal handler runs.

`spotguard launch` starts each worker with PR_SET_PDEATHSIG = SIGTERM and its own pid in
`SPOTGUARD_LAUNCHER_PID`. The SIGTERM becomes a drain notice (the Guard's signal trap), acted on
at the next step boundary; but a rank blocked in a collective or a re-form runs no Python
signal handler until that call returns.

Contract: `OrphanWatch.from_env(grace_seconds)` is None unless `SPOTGUARD_LAUNCHER_PID` is set
(a worker started some other way, `nohup` included, is never watched). `start()` runs a daemon
thread that checks every `poll` seconds whether the launcher still runs (this process's parent
is still the one it started with, which is the launcher or what the launcher started, and the
launcher's pid still exists); once it does not, the worker has `grace_seconds` (the drain's own
grace) to end by itself, then the thread logs one line, flushes and ends the process with exit
status 1. `stop()` ends the watch (the Guard closed: the process is leaving on its own).
"""
from __future__ import annotations

import logging
import os
import threading

from spotguard.processes import flush_and_exit
from spotguard.wire import names

log = logging.getLogger("spotguard.hooks.orphan_watch")

EXIT_ORPHANED = 1


class OrphanWatch:
    """See the module docstring."""

    def __init__(self, launcher_pid: int, grace_seconds: float, poll: float = 0.2):
        self.launcher_pid, self.grace_seconds, self.poll = launcher_pid, grace_seconds, poll
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spotguard-orphan-watch", daemon=True)

    @classmethod
    def from_env(cls, grace_seconds: float, env: dict[str, str] | None = None) -> OrphanWatch | None:
        text = (os.environ if env is None else env).get(names.ENV_LAUNCHER_PID, "")
        if not text.strip().isdigit():
            return None
        return cls(int(text), grace_seconds)

    def start(self) -> OrphanWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def launcher_gone(self) -> bool:
        if os.getppid() != self._parent:
            return True
        try:
            os.kill(self.launcher_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of another user: it exists
            pass
        return False

    def _watch(self) -> None:
        while not self.launcher_gone():
            if self._stop.wait(self.poll):
                return
        if self._stop.wait(self.grace_seconds):
            return
        log.error("launcher %d is gone and this worker did not leave within %gs: exiting", self.launcher_pid,
                  self.grace_seconds)
        flush_and_exit(EXIT_ORPHANED)
