"""A preloaded Python for the tests' worker processes: imports torch (and its distributed
checkpoint, whose import pulls in DTensor and sympy) once, then forks one child per request and
runs the requested script or module in it as `python` would. tests/workers/zygote.py is the
client and says why and when it is used.

Protocol, on the Unix socket at argv[1]: the client connects and sends one JSON request (length
first) with its stdin, stdout and stderr as SCM_RIGHTS file descriptors; the server forks and
answers `{"pid": n}`, then, once the child exited, `{"returncode": n}` (Popen's convention: minus
the signal that killed it) and closes the connection.

The child: its own session if asked, the three descriptors as 0/1/2, the request's environment
(os.environ, so C code's getenv sees it too), working directory and argv, fresh seeds for
`random`, default signal dispositions; then `runpy` runs the script or module as `__main__`, and
the interpreter ends as any python does (atexit, thread joins, the exit code of SystemExit or 1
with the traceback of an uncaught exception).

The server stays single-threaded (forking a process with other threads is unsafe): it refuses
to start (exit 3) when an import left another thread running. It ends when the process that
started it is gone.
"""
from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.nn.parallel", "torch.optim", "numpy")


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    while len(head) < 4:
        more = conn.recv(4 - len(head))
        if not more:
            raise ConnectionError("the client closed the connection")
        head += more
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("the client closed the connection")
        body += more
    return json.loads(body), fds


def serve(path: str) -> tuple[dict, list[int]]:
    """Forks a child per request; returns (request, descriptors) in the child only."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client connects once the path exists: bound and listening
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([server, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = children.pop(pid)
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        if server not in ready:
            continue
        conn, _ = server.accept()
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sock in (server, conn, *children.values()):
                sock.close()
            os.close(wake_r)
            os.close(wake_w)
            return request, fds
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn
    sys.exit(0)


def become(request: dict, fds: list[int]) -> None:
    """This child as `python <argv>` would start (module docstring)."""
    import random

    if request.get("new_session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), write_through=unbuffered,
                                  line_buffering=name == "stderr" or os.isatty(fd), errors="backslashreplace")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run(request: dict) -> None:
    import runpy

    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    if len(os.listdir("/proc/self/task")) != 1:
        print("zygote: an import started a thread; forking would be unsafe", file=sys.stderr)
        sys.exit(3)
    request, fds = serve(sys.argv[1])
    become(request, fds)
    run(request)


if __name__ == "__main__":
    main()
