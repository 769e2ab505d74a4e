"""Worker processes of the multi-process tests, forked from a preloaded Python (tests/workers/zygote_server.py).

Every rank a test starts used to import torch and its distributed checkpoint from scratch: ~2.5 s
of CPU per process, most of the suite's CPU on a 2-core machine (hundreds of ranks). `popen()`
starts `python <argv>` as `subprocess.Popen` would, with the same environment, working directory
and output files, but forked from a server that has those imports done: the rank then runs the
same script or module, in its own process, with its own PID, exit code and signals.

What it does not change: the product's own process starts (`spotguard launch` starting a
worker, the dry-run's pods) and any start the server cannot reproduce exactly take the real
`subprocess.Popen`: another Python, an environment that differs from the server's in a variable
read while those imports ran (`IMPORT_TIME_ENV`), stdin or output pipes, or no server. Ranks are
forked from two servers in turn, each with its own hash seed, so a rank never shares its seed with
the rank started just before it (two real processes would not share one; an order of a set of
strings that differs across ranks stays visible to the tests, whose runs have two or three ranks:
the first two always differ). `SPOTGUARD_TEST_ZYGOTE=0` turns it off.

The object returned answers `pid`, `args`, `returncode`, `poll()`, `wait(timeout)`,
`send_signal()`, `terminate()` and `kill()` as Popen does (signals go to the PID; the exit status
comes from the server, which reaps the child).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVERS = 2
START_TIMEOUT = 120.0
# Read by Python or by the preloaded libraries while they are imported: a start whose value differs
# from the server's cannot be reproduced by a fork.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHOME", "PYTHONWARNINGS",
                   "PYTHONFAULTHANDLER", "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONOPTIMIZE", "PYTHONSAFEPATH",
                   "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONUTF8", "PYTHONIOENCODING", "TORCH_LOGS")


class Server:
    """One preloaded server process, started by this (pytest worker) process."""

    def __init__(self, hash_seed: int):
        self.dir = tempfile.mkdtemp(prefix="spotguard-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
        self.env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED=str(hash_seed))
        self.env.pop("PYTHONUNBUFFERED", None)
        self.log = open(os.path.join(self.dir, "log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.workers.zygote_server", self.path], env=self.env,
                                     cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready = False

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        self.ready = True
        return True

    def accepts(self, env: dict[str, str]) -> bool:
        return all(env.get(k) == self.env.get(k) for k in IMPORT_TIME_ENV if k != "PYTHONHASHSEED") \
            and "PYTHONHASHSEED" not in env

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        for name in ("sock", "log"):
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


class Forked:
    """A child of a server, answering as subprocess.Popen does (module docstring)."""

    def __init__(self, args: list[str], conn: socket.socket):
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._message(None)["pid"])

    def _message(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            data = self._conn.recv(4096)
            if not data:
                raise ConnectionError(f"the zygote server of pid {getattr(self, 'pid', '?')} went away")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._message(timeout)["returncode"])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


_lock = threading.Lock()
_servers: dict[int, list[Server]] = {}  # by the PID that started them (a forked pytest worker starts its own)
_turn = [0]


def _servers_here() -> list[Server]:
    with _lock:
        servers = _servers.get(os.getpid())
        if servers is None:
            seeds = [int.from_bytes(os.urandom(4), "big") % 4294967295 + 1 for _ in range(SERVERS)]
            servers = _servers[os.getpid()] = [Server(seed) for seed in seeds]
            atexit.register(_close, os.getpid())
        return [s for s in servers if s.ready or s.wait_ready()]


def _close(pid: int) -> None:
    for server in _servers.pop(pid, []) if pid == os.getpid() else []:
        server.close()


def _spawn(server: Server, argv: list[str], env: dict[str, str], cwd: str, stdout: int, stderr: int,
           new_session: bool) -> Forked:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server.path)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "new_session": new_session}).encode()
        with open(os.devnull, "rb") as stdin:
            socket.send_fds(conn, [struct.pack("!I", len(body))], [stdin.fileno(), stdout, stderr])
        conn.sendall(body)
        return Forked([sys.executable, *argv], conn)
    except BaseException:
        conn.close()
        raise


def forkable(argv: list[str]) -> bool:
    """A script or `-m module` the server can run; not the product's CLI (`-m spotguard ...`: its
    launcher starts the workers the real way, as in a pod)."""
    if not argv or (argv[0].startswith("-") and argv[0] != "-m"):
        return False
    return argv[0] != "-m" or (len(argv) > 1 and argv[1] != "spotguard" and not argv[1].startswith("spotguard.cli"))


def popen(argv: list[str], *, env: dict[str, str], cwd: str | Path, stdout: Any, stderr: Any = None,
          start_new_session: bool = False) -> subprocess.Popen | Forked:
    """`subprocess.Popen([sys.executable, *argv], ...)`, forked from a preloaded server when it can
    be (module docstring). `stdout`: an open file; `stderr`: an open file or subprocess.STDOUT."""
    out = stdout.fileno()
    err = out if stderr in (None, subprocess.STDOUT) else stderr.fileno()
    if os.environ.get("SPOTGUARD_TEST_ZYGOTE", "1") != "0" and forkable(argv):
        servers = _servers_here()
        usable = [s for s in servers if s.accepts(env)]
        if usable:
            _turn[0] += 1
            server = usable[_turn[0] % len(usable)]
            try:
                return _spawn(server, argv, env, str(cwd), out, err, start_new_session)
            except OSError:
                pass  # the server is gone: the real start below
    return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=stdout,
                            stderr=subprocess.STDOUT if stderr in (None, subprocess.STDOUT) else stderr,
                            start_new_session=start_new_session)
