"""A stand-in sidecar for Guard tests: a real aiohttp server on 127.0.0.1:0 in a background thread.

Serves what docs/protocols.md says the sidecar serves to the Guard: `GET /v1/stream` (SSE:
a snapshot on connect, and the pod's membership once `push_membership` set one, as the real
sidecar sends it; then whatever the test pushes) and `POST /v1/hooks` (bearer token
checked, bodies recorded). Tests push notices, withdrawals or raw (malformed) bytes.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from spotguard.wire.sse import encode


class SidecarStub:
    def __init__(self, token: str = "test-token", snapshot: list[dict] | None = None):
        self.token = token
        self.snapshot = list(snapshot or [])
        self.reports: list[dict[str, Any]] = []
        self.rejected: list[str] = []
        self.connections = 0
        self.membership: dict | None = None
        self._queues: list[asyncio.Queue] = []
        self._seq = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sidecar-stub", daemon=True)
        self.url = ""

    def __enter__(self) -> SidecarStub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/stream", self._stream)
        app.router.add_post("/v1/hooks", self._hooks)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        for queue in list(self._queues):
            queue.put_nowait(None)
        await asyncio.sleep(0.05)
        await self._runner.cleanup()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.append(queue)
        self.connections += 1
        try:
            self._seq += 1
            await response.write(encode("snapshot", {"v": 1, "node": "n1", "notices": self.snapshot}, self._seq))
            if self.membership is not None:
                self._seq += 1
                await response.write(encode("membership", json.dumps(self.membership), self._seq))
            while True:
                frame = await queue.get()
                if frame is None:
                    break
                await response.write(frame)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._queues.remove(queue)
        return response

    async def _hooks(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.rejected.append(request.headers.get("Authorization", ""))
            return web.json_response({"error": "unauthorized"}, status=401)
        self.reports.append(await request.json())
        return web.json_response({"ok": True})

    # ---- called from the test thread -------------------------------------------------------
    def wait_for_connection(self, procs: Sequence[subprocess.Popen] = (), timeout: float = 240) -> None:
        """Until a Guard's stream is connected (a notice pushed before would reach nobody); raises
        AssertionError when one of `procs` exited first or after `timeout` (a loaded machine only)."""
        end = time.monotonic() + timeout
        while self.connections < 1:
            if any(p.poll() is not None for p in procs):
                raise AssertionError("a rank exited before its Guard connected to the sidecar")
            if time.monotonic() > end:
                raise AssertionError(f"no Guard connected to the sidecar in {timeout}s")
            time.sleep(0.02)

    def push_raw(self, frame: bytes) -> None:
        def put() -> None:
            for queue in self._queues:
                queue.put_nowait(frame)
        self._loop.call_soon_threadsafe(put)

    def push(self, event: str, data: Any) -> None:
        self._seq += 1
        self.push_raw(encode(event, data if isinstance(data, str) else json.dumps(data), self._seq))

    def push_membership(self, data: dict) -> None:
        """The pod's membership from now on: sent to every stream now and on every connect."""
        self.membership = data
        self.push("membership", data)

    def drop_connections(self) -> None:
        self.push_raw(None)  # type: ignore[arg-type] - None ends each stream handler
