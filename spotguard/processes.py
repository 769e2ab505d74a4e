"""Helpers for the local processes a command or a test starts: a child that dies with its
parent, a free loopback port for one to listen on, and an exit that skips interpreter teardown.
Imports no part of spotguard.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import sys
import tempfile
import time
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


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000
PORT_TRIES = 64


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), None where it cannot be read."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if low > LOWEST_PORT + PORT_TRIES else None


PORT_CLAIMS = os.path.join(tempfile.gettempdir(), "spotguard-port-claims")
PORT_CLAIM_SECONDS = 300.0  # how long a port handed out stays away from every other caller


def _claim(port: int) -> bool:
    """Claims `port` for this caller across processes (a file per port, created exclusively,
    taken over once older than PORT_CLAIM_SECONDS); True where claims cannot be kept at all."""
    try:
        os.makedirs(PORT_CLAIMS, mode=0o1777, exist_ok=True)
    except OSError:
        return True
    path = os.path.join(PORT_CLAIMS, str(port))
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(path).st_mtime < PORT_CLAIM_SECONDS:
                    return False
                os.unlink(path)  # stale: whoever unlinks and creates first has it
            except OSError:
                continue
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server started next.

    Taken below the kernel's ephemeral range where it is known: a port from that range (what
    binding port 0 gives) can be taken, between this call and the server's bind, as the local
    end of any outgoing connection (gloo opens many), and the server then fails with
    EADDRINUSE. A port handed out is claimed for PORT_CLAIM_SECONDS in a folder every process
    of this machine shares, so two callers (two test runs at once) never get the same one while
    the first may still be starting its server. Elsewhere, or when no port below the range is
    free, the kernel's choice."""
    low = _ephemeral_low()
    candidates = random.sample(range(LOWEST_PORT, low), min(PORT_TRIES, low - LOWEST_PORT)) if low else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _claim(port):
            return port
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
