"""The agent's HTTP API (aiohttp), as docs/protocols.md specifies it.

Read-only, open (they reveal only what the node's metadata service already says):
- `GET /v1/notices` -> `{"v": 1, "node": ..., "notices": [...]}`, most urgent first.
- `GET /v1/stream` -> Server-Sent Events: `event: snapshot`
  (`{"v":1,"node":...,"notices":[...],"complete":bool}`, wire/snapshot.py) on connect, then
  `event: notice` (a new or changed notice) and `event: withdrawn` (a withdrawal), and one more
  `event: snapshot` (complete) when the table becomes complete after the subscriber connected.
  Every event has `id: <sequence number>` (a snapshot's id is the sequence number it reflects,
  so the next change has a higher one); `: keepalive` every `keepalive` seconds. A subscriber
  with more than `max_buffered` bytes unsent is disconnected; reconnecting gives a fresh
  snapshot, so nothing is lost. The stream ends cleanly when the agent stops. Streams are
  bounded: `max_subscribers` in all (503 past it) and `max_per_client` per client IP address
  (429 past it), both with `Retry-After`.
- `GET /metrics` (Prometheus text), `GET /healthz` (200 while the loop runs), `GET /readyz`
  (200 once ready, else 503; JSON says which sources are still pending).
State-changing, authenticated (see agent/auth.py):
- `POST /v1/reports` -> 202 `{"recorded": true, "approved": bool, ...}`; 400 bad body (names
  the field; not UTF-8 JSON, nested too deep, broken), 401/403 authentication, 404 no such live
  notice, 408 body not sent within `body_timeout`, 413 body too large, 503 auth backend
  unreachable.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any
from collections.abc import Callable

from aiohttp import web

from spotguard.agent.auth import Authenticator, AuthError
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reports import ReportBook
from spotguard.agent.table import TICK, NoticeTable, Published, Resync
from spotguard.http_server import BodyError, client_address, read_json
from spotguard.metrics import CONTENT_TYPE
from spotguard.stream_slots import SlotRefused, StreamSlots
from spotguard.wire.agent_report import ReportFormatError, parse_report
from spotguard.wire.notice import Notice
from spotguard.wire.snapshot import snapshot_wire
from spotguard.wire.sse import KEEPALIVE, encode

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 64 * 1024
Readiness = Callable[[], "tuple[bool, dict[str, Any]]"]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class AgentServer:
    """Builds the aiohttp application over a table, metrics, readiness check and report book."""

    def __init__(self, table: NoticeTable, metrics: AgentMetrics, readiness: Readiness,
                 reports: ReportBook, authenticator: Authenticator, keepalive: float = 10.0,
                 max_subscribers: int = 512, max_per_client: int | None = 32, max_buffered: int = 1 << 20,
                 body_timeout: float = 10.0):
        self.table = table
        self.metrics = metrics
        self.readiness = readiness
        self.reports = reports
        self.authenticator = authenticator
        self.keepalive = keepalive
        self.slots = StreamSlots(max_subscribers, max_per_client)
        self.body_timeout = body_timeout
        self.max_buffered = max_buffered  # bytes unsent to one subscriber before it is cut off
        self._frames: dict[int, bytes] = {}  # seq -> encoded frame, shared by every subscriber

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REPORT_BYTES)
        app.cleanup_ctx.append(self._keepalive_ctx)
        app.add_routes([
            web.get("/v1/notices", self.notices),
            web.get("/v1/stream", self.stream),
            web.get("/metrics", self.metrics_text),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.post("/v1/reports", self.post_report),
        ])
        return app

    async def _keepalive_ctx(self, app: web.Application):
        """One timer for every stream: each tick wakes idle subscribers to send a keepalive
        (cheaper than a timeout per subscriber per event)."""
        async def beat() -> None:
            while True:
                await asyncio.sleep(self.keepalive)
                self.table.tick()

        task = asyncio.create_task(beat(), name="sse-keepalive")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _snapshot(self, notices: list[Notice], complete: bool) -> dict[str, Any]:
        return snapshot_wire(self.table.node, notices, complete)

    # -- read-only -----------------------------------------------------------------------------

    async def notices(self, request: web.Request) -> web.Response:
        return web.json_response(self._snapshot(self.table.live(), self.table.complete), dumps=_dumps)

    def frame(self, published: Published | Resync) -> bytes:
        """The SSE frame of a change, encoded once however many subscribers send it."""
        if isinstance(published, Resync):
            return encode("snapshot", self._snapshot(published.notices, True), id=published.seq)
        frame = self._frames.get(published.seq)
        if frame is None:
            change = published.change
            event = "notice" if isinstance(change, Notice) else "withdrawn"
            frame = encode(event, change.to_wire(), id=published.seq)
            if len(self._frames) >= 256:
                for seq in sorted(self._frames)[:128]:
                    del self._frames[seq]
            self._frames[published.seq] = frame
        return frame

    async def stream(self, request: web.Request) -> web.StreamResponse:
        try:
            slot = self.slots.take(client_address(request))
        except SlotRefused as exc:
            self.metrics.streams_refused.inc(status=str(exc.status))
            return web.json_response({"error": exc.message}, status=exc.status, headers={"Retry-After": "1"})
        try:
            return await self._serve_stream(request)
        finally:
            slot.release()

    async def _serve_stream(self, request: web.Request) -> web.StreamResponse:
        sub = self.table.subscribe()
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if request.version >= (1, 1):
            response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            await response.write(encode("snapshot", self._snapshot(sub.snapshot, sub.complete), id=sub.seq))
            # From here on the table writes each change straight to this connection as it
            # publishes it (one pre-encoded frame for all subscribers, no task wake-up each).
            sub.attach(self._sink(request.transport, response.chunked))
            while await sub.next() is not None:
                pass
            if sub.overflowed:  # megabytes unread: drop them, the subscriber reconnects
                self.metrics.dropped.inc()
                log.warning("stream subscriber fell behind; disconnected (it will get a fresh snapshot)",
                            extra={"peer": request.remote})
                if request.transport is not None:
                    request.transport.abort()
            elif request.transport is not None and not request.transport.is_closing():
                await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the subscriber went away
        finally:
            sub.close()
        return response

    def _sink(self, transport: asyncio.Transport | None, chunked: bool):
        """A synchronous writer of SSE frames to one connection (see Subscription.attach)."""
        def deliver(item: object) -> str | None:
            if transport is None or transport.is_closing():
                return "gone"
            if transport.get_write_buffer_size() > self.max_buffered:
                return "full"
            frame = KEEPALIVE if item is TICK else self.frame(item)  # type: ignore[arg-type]
            transport.write(b"%x\r\n%b\r\n" % (len(frame), frame) if chunked else frame)
            return None
        return deliver

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        ready, detail = self.readiness()
        return web.json_response({"ready": ready, **detail}, status=200 if ready else 503)

    # -- authenticated -------------------------------------------------------------------------

    async def post_report(self, request: web.Request) -> web.Response:
        try:
            caller = await self.authenticator.authenticate(request.headers.get("Authorization"))
        except AuthError as exc:
            self.metrics.reports.inc(result=f"auth_{exc.status}")
            headers = {"WWW-Authenticate": 'Bearer realm="spotguard"'} if exc.status == 401 else None
            return web.json_response({"error": exc.message}, status=exc.status, headers=headers)
        try:
            report = parse_report(await read_json(request, MAX_REPORT_BYTES, self.body_timeout))
        except BodyError as exc:
            self.metrics.reports.inc(result="too_large" if exc.status == 413 else "bad_request")
            return web.json_response({"error": exc.message}, status=exc.status)
        except ReportFormatError as exc:
            self.metrics.reports.inc(result="bad_request")
            return web.json_response({"error": str(exc)}, status=400)
        if not caller.may_report_for(report.namespace, report.pod):
            self.metrics.reports.inc(result="forbidden")
            return web.json_response({"error": "the token does not belong to that pod"}, status=403)
        report = dataclasses.replace(report, caller=caller.name, received_at=time.time())
        try:
            outcome = await self.reports.record(report)
        except KeyError:
            self.metrics.reports.inc(result="unknown_notice")
            return web.json_response({"error": f"notice_id: no live notice {report.notice_id!r}"}, status=404)
        except OverflowError as exc:
            self.metrics.reports.inc(result="too_many")
            return web.json_response({"error": str(exc)}, status=429)
        self.metrics.reports.inc(result="accepted")
        log.info("report %s from %s/%s", report.status, report.namespace, report.pod,
                 extra={"notice_id": report.notice_id, "caller": caller.name, "step": report.step})
        return web.json_response(outcome.to_wire(), status=202)
