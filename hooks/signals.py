"""SIGTERM (and any configured signal) as a `drain` notice, so drains started by other tools checkpoint too.

Contract:
- `SignalTrap.install()` replaces the handlers of its signals (main thread only; elsewhere it
  logs and installs nothing) and supersedes `early_exit`'s handler for good; `uninstall()` puts
  the previous handlers back.
- The handler only records (signal number, wall time) in one attribute: no I/O, no allocation
  beyond a tuple, one lock held for a few assignments. The first signal wins until `take()`
  consumes it.
- `wakeup(signum)`: the deadline watchdog read `signum` from the signal wakeup fd, which the
  interpreter writes before the handler runs (the main thread may be blocked in C and run no
  handler yet). Each path counts the deliveries it saw and only the first to see a delivery
  records it: a handler that ran (and a `take()` that consumed it) before the watchdog read its
  byte leaves nothing behind, where recording it again made a second notice, with its own id
  and a later deadline, for a signal that came once. The Guard installs the trap after the
  watchdog took the fd, so both see every delivery from the start. The counts drift only when
  the interpreter runs the handler once for deliveries that arrive together (the fd gets a byte
  for each): the wakeup count is then ahead, and later deliveries are recorded when the
  watchdog reads their bytes (at once: its thread waits on the fd), not by the handler.
- `take()` (called from the training loop, never from the handler) turns the recorded signal
  into a `Notice(kind=drain, source="signal", deadline=received + grace_seconds)`; the id is
  stable for one delivery, so the same signal never makes two notices. `peek()` is the same
  notice without consuming it.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, UTC
from types import FrameType
from typing import Any

from spotguard.hooks import early_exit
from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice, notice_id

log = logging.getLogger("spotguard.hooks.signals")

SOURCE = names.SIGNAL_SOURCE


def node_name() -> str:
    """The node this process runs on, as the notices name it (SPOTGUARD_NODE, NODE_NAME, else the
    host name)."""
    import os

    return os.environ.get("SPOTGUARD_NODE") or os.environ.get("NODE_NAME") or socket.gethostname() or "localhost"


class SignalTrap:
    """Records SIGTERM and the extra signals; `take()` makes the drain notice outside the handler."""

    def __init__(self, grace_seconds: float, signals: tuple[int, ...] = (signal.SIGTERM,), node: str | None = None):
        self.grace_seconds = float(grace_seconds)
        self.signals = tuple(dict.fromkeys(int(s) for s in signals))
        self.node = node or node_name()
        self.received: tuple[int, float] | None = None
        self._seen = {"handler": 0, "wakeup": 0}  # deliveries each path saw
        self._recorded = 0  # deliveries recorded (by whichever path saw each first)
        self._counting = threading.RLock()  # RLock: a handler may run inside another's count
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def install(self) -> bool:
        """Installs the handlers; False (with a log line) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers not installed: the Guard was created off the main thread")
            return False
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        early_exit.supersede()
        return True

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # signal handler signature
        self._count(signum, "handler")

    def wakeup(self, signum: int) -> None:
        """See the module docstring (the deadline watchdog's thread)."""
        if signum in self.signals:
            self._count(signum, "wakeup")

    def _count(self, signum: int, path: str) -> None:
        with self._counting:
            self._seen[path] += 1
            if self._seen[path] <= self._recorded:  # the other path saw this delivery first
                return
            self._recorded = self._seen[path]
            if self.received is None:
                self.received = (signum, time.time())

    def take(self) -> Notice | None:
        """The drain notice for the recorded signal (once), or None when none arrived."""
        notice = self.peek()
        self.received = None
        return notice

    def peek(self) -> Notice | None:
        """The drain notice `take()` would return, left recorded (the deadline watchdog's look)."""
        received = self.received
        if received is None:
            return None
        signum, at = received
        detected = datetime.fromtimestamp(at, UTC)
        name = signal.Signals(signum).name
        return Notice(
            id=notice_id(SOURCE, self.node, name, f"{at:.6f}"),
            kind=Kind.DRAIN,
            source=SOURCE,
            node=self.node,
            detected_at=detected,
            deadline=detected + timedelta(seconds=self.grace_seconds),
            detail={"signal": name, "grace_seconds": self.grace_seconds},
        )
