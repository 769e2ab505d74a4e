"""Helpers for the local processes a command or a test starts: a child that dies with its
parent, a free loopback port for one to listen on, and an exit that skips interpreter teardown.
Imports no part of spotguard.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import NoReturn


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for subprocesses: the child gets `sig` when the process that started it
    dies (Linux PR_SET_PDEATHSIG), so a killed launcher leaves no orphan behind. Elsewhere, or
    where libc cannot be loaded, it does nothing. libc is loaded here, in the parent, so the
    child runs no import between fork and exec (safe beside the event loop's watcher threads)."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None

    def set_parent_death_signal() -> None:
        prctl(1, sig)  # 1 = PR_SET_PDEATHSIG

    return set_parent_death_signal


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flush_and_exit(code: int) -> NoReturn:
    """Ends this process with `code` at once: logging and stdio are flushed first, then
    `os._exit` skips the interpreter's teardown (torch's C++ teardown can abort in gloo, and a
    thread blocked in a collective would hold a normal exit)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
