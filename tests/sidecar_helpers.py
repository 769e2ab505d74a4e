"""Test parts for the sidecar: an agent-like publisher on a real socket and an SSE reader.

`Publisher` speaks the agent's protocol (docs/protocols.md): GET /v1/stream (snapshot on
connect, then notice/withdrawn events, ids, keepalives) and POST /v1/reports (bearer token
checked, bodies recorded). The test drives it: add/withdraw notices, drop every connection,
refuse the next connects, inject raw bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from datetime import timedelta
from typing import Any
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from spotguard.hooks.sidecar.service import Sidecar, SidecarConfig
from spotguard.wire.notice import Kind, Notice, notice_id, now_utc, Severity
from spotguard.wire.sse import KEEPALIVE, SSEDecoder, encode
from spotguard.wire.withdrawal import Withdrawal


def make_notice(node: str = "node-a", kind: Kind = Kind.RECLAIM, deadline_in: float | None = 120.0,
                tag: str = "1", severity: Severity = Severity.ACT) -> Notice:
    deadline = None if deadline_in is None else now_utc() + timedelta(seconds=deadline_in)
    return Notice(id=notice_id("test.src", node, kind.value, tag), kind=kind, source="test.src", node=node,
                  detected_at=now_utc(), deadline=deadline, detail={"tag": tag}, severity=severity)


class Publisher:
    """An agent stand-in. `async with Publisher() as pub:`; `pub.url` is its base URL."""

    def __init__(self, node: str = "node-a", report_token: str | None = None):
        self.node = node
        self.report_token = report_token or secrets.token_urlsafe(16)
        self.live: dict[str, dict] = {}
        self.connections = 0
        self.refuse_next = 0
        self.reports: list[dict] = []
        self.report_auth: list[str] = []
        self.report_statuses: list[int] = []  # statuses to answer with first (then 200)
        self.complete: bool | None = None  # the snapshots' `complete` (None: the field is left out)
        self._streams: set[web.StreamResponse] = set()
        self._queues: set[asyncio.Queue] = set()
        self._seq = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> Publisher:
        app = web.Application()
        app.router.add_get("/v1/stream", self._stream)
        app.router.add_post("/v1/reports", self._report)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.drop_connections()
        await self._runner.cleanup()

    def _next_id(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, frame: bytes) -> None:
        for queue in list(self._queues):
            queue.put_nowait(frame)

    def add(self, notice: Notice) -> None:
        self.live[notice.id] = notice.to_wire()
        self._send(encode("notice", notice.to_wire(), self._next_id()))

    def withdraw(self, notice: Notice, silently: bool = False) -> None:
        """Removes a notice; `silently`: as if the event was lost while disconnected."""
        self.live.pop(notice.id, None)
        if not silently:
            self._send(
                encode("withdrawn", Withdrawal(notice.id, notice.source, notice.node).to_wire(), self._next_id()))

    def add_silently(self, notice: Notice) -> None:
        self.live[notice.id] = notice.to_wire()

    def send_raw(self, frame: bytes) -> None:
        self._send(frame)

    def drop_connections(self) -> None:
        for queue in list(self._queues):
            queue.put_nowait(None)

    def snapshot(self) -> dict:
        body = {"v": 1, "node": self.node, "notices": list(self.live.values())}
        if self.complete is not None:
            body["complete"] = self.complete
        return body

    def resync(self) -> None:
        """Becomes complete and sends every subscriber a fresh snapshot, as the agent does."""
        self.complete = True
        self._send(encode("snapshot", self.snapshot(), self._next_id()))

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_next > 0:
            self.refuse_next -= 1
            return web.json_response({"error": "not ready"}, status=503)
        self.connections += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.add(queue)
        try:
            await resp.write(encode("snapshot", self.snapshot(), self._next_id()))
            while True:
                try:
                    frame = await asyncio.wait_for(queue.get(), 1.0)
                except TimeoutError:
                    await resp.write(KEEPALIVE)
                    continue
                if frame is None:
                    break
                await resp.write(frame)
        except ConnectionError:
            pass
        finally:
            self._queues.discard(queue)
        if request.transport is not None:
            request.transport.close()  # a dropped connection, not a clean end
        return resp

    async def _report(self, request: web.Request) -> web.Response:
        self.report_auth.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {self.report_token}":
            return web.json_response({"error": "bad token"}, status=401)
        if self.report_statuses:
            status = self.report_statuses.pop(0)
            return web.json_response({"error": "try later"}, status=status)
        self.reports.append(await request.json())
        return web.json_response({"ok": True})


class StreamReader:
    """Reads an SSE stream in the background; `next()` returns (event, data) in order."""

    def __init__(self, url: str):
        self.url = url
        self.events: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamReader:
        self._session = aiohttp.ClientSession(trust_env=False)
        resp = await self._session.get(self.url + "/v1/stream", timeout=aiohttp.ClientTimeout(total=None, sock_read=30))
        assert resp.status == 200, resp.status
        assert resp.headers["Content-Type"].startswith("text/event-stream")

        async def pump() -> None:
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                for event in decoder.feed(chunk):
                    await self.events.put((event.event, json.loads(event.data), event.id))
            await self.events.put(("<closed>", None, None))

        self._task = asyncio.create_task(pump())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        await self._session.close()

    async def next(self, timeout: float = 5.0) -> tuple[str, Any]:
        event, data, _id = await asyncio.wait_for(self.events.get(), timeout)
        return event, data

    async def quiet(self, seconds: float) -> None:
        """Asserts that no event arrives within `seconds`."""
        try:
            event = await asyncio.wait_for(self.events.get(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected event {event!r}")


async def eventually(predicate, timeout: float = 5.0, pause: float = 0.02, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(pause)


def sidecar_config(tmp_path, agent_url: str, **overrides: Any) -> SidecarConfig:
    values = dict(agent_url=agent_url, token_file=str(tmp_path / "run" / "token"), listen_port=0,
                  podinfo_interval=0.05, keepalive=1.0, agent_idle_timeout=3.0, report_give_up=10.0,
                  pod="trainer-0", namespace="ml")
    values.update(overrides)
    return SidecarConfig(**values)


@contextlib.asynccontextmanager
async def running_sidecar(tmp_path, agent_url: str, settle: bool = True, **overrides: Any) -> AsyncIterator[Sidecar]:
    """A started sidecar; with `settle`, only once it applied its agent's first complete snapshot,
    so a subscriber opened next gets one complete snapshot (no later resync snapshot)."""
    async with Sidecar(sidecar_config(tmp_path, agent_url, **overrides)) as sidecar:
        if settle:
            await eventually(lambda: sidecar.live.complete, timeout=10, what="the sidecar heard from its agent")
        yield sidecar


def read_token(sidecar: Sidecar) -> str:
    with open(sidecar.config.token_file) as f:
        return f.read().strip()


def write_annotations(podinfo_dir, lines: list[str]) -> None:
    """Replaces the annotations file the way the kubelet does: a new file, swapped in."""
    os.makedirs(podinfo_dir, exist_ok=True)
    tmp = os.path.join(podinfo_dir, ".annotations.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(podinfo_dir, "annotations"))


def go_quote(text: str) -> str:
    """Go's %q for the characters these tests use (printable ASCII, quotes, \\n, non-ASCII)."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7f:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def hook(notice_id: str, rank: int, phase: str = "checkpoint-durable", world_size: int = 2, **extra) -> dict:
    return {"v": 1, "notice_id": notice_id, "rank": rank, "world_size": world_size, "step": 120,
            "phase": phase, "seconds": 1.25 + rank, **extra}


async def post_hook(http: aiohttp.ClientSession, sc, body, token: str | None = "__sidecar__") -> tuple[int, dict]:
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {read_token(sc) if token == '__sidecar__' else token}"
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with http.post(sc.url + "/v1/hooks", data=data, headers=headers) as resp:
        return resp.status, await resp.json()


async def prestop(http: aiohttp.ClientSession, sc, timeout: float | str) -> dict:
    async with http.get(sc.url + "/v1/prestop", params={"timeout": str(timeout)}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def live_notice(pub, sc, **kw):
    notice = make_notice(**kw)
    await eventually(lambda: pub.connections >= 1)
    pub.add(notice)
    await eventually(lambda: sc.live.get(notice.id) is not None, what="notice relayed")
    return notice
