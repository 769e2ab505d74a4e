"""The sidecar's HTTP API for the pod's processes (default 127.0.0.1:9741).

Loopback TCP rather than a unix socket: torchrun workers, the deepspeed launcher and any other
launcher reach it with plain HTTP and an address from the environment, with no shared volume
to mount into every container; a pod's loopback belongs to the pod's network namespace, which
only its own containers share.

Endpoints (docs/protocols.md, "Sidecar"):
- GET /v1/notices: `{"v": 1, "node", "notices": [...]}`, most urgent first;
- GET /v1/stream: SSE; `snapshot` on connect (`complete` once the agent's snapshot was, see
  wire/snapshot.py; a fresh complete `snapshot` follows when that happens later), then the
  current `membership` (if any), then `notice` / `withdrawn` / `membership` as they happen,
  each with a sequence `id`; `: keepalive` every `keepalive` s; a reader `max_queue` events
  behind is disconnected; at most `max_streams` open at once (503 past it);
- POST /v1/hooks: `Authorization: Bearer <token>` (compared as bytes in constant time, any
  header encoding), body a `HookReport`; 401 without a valid token, 400 with `{"error": ...}`
  for a malformed body (not UTF-8 JSON, nested too deep, broken), 408 when it is not sent
  within `body_timeout` s, 413 past `MAX_BODY`, in every case changing nothing; 200 with the
  pod's progress for that notice;
- GET /v1/prestop?timeout=s (default 120, at most 3600): see `prestop.wait_for_pod`; 200 with
  the outcome either way;
- GET /healthz: `{"ok": true, "agent_connected": bool}`.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from spotguard.hooks.sidecar.broadcast import CLOSED, CUT_OFF
from spotguard.hooks.sidecar.prestop import wait_for_pod
from spotguard.http_server import BodyError, client_address, read_json
from spotguard.stream_slots import SlotRefused, StreamSlots
from spotguard.wire.hook_report import HookFormatError, HookReport
from spotguard.wire.sse import KEEPALIVE, encode

if TYPE_CHECKING:
    from spotguard.hooks.sidecar.service import Sidecar

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
DEFAULT_PRESTOP_TIMEOUT = 120.0
MAX_PRESTOP_TIMEOUT = 3600.0


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


class SidecarAPI:
    """Route handlers over a running `Sidecar`'s state."""

    def __init__(self, sidecar: Sidecar, keepalive: float = 10.0, max_streams: int = 256,
                 body_timeout: float = 10.0):
        self.sidecar = sidecar
        self.keepalive = keepalive
        self.slots = StreamSlots(max_streams)
        self.body_timeout = body_timeout

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/v1/notices", self.notices)
        app.router.add_get("/v1/stream", self.stream)
        app.router.add_post("/v1/hooks", self.hooks)
        app.router.add_get("/v1/prestop", self.prestop)
        app.router.add_get("/healthz", self.healthz)
        return app

    async def notices(self, request: web.Request) -> web.Response:
        return web.json_response(self.sidecar.snapshot_wire())

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "agent_connected": self.sidecar.relay.connected})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        try:
            slot = self.slots.take(client_address(request))
        except SlotRefused as exc:
            return _error(exc.status, exc.message, **{"Retry-After": "1"})
        try:
            return await self._serve_stream(request)
        finally:
            slot.release()

    async def _serve_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        broadcaster = self.sidecar.broadcaster
        # Subscribe and take the snapshot with no await in between: nothing is missed or repeated.
        queue = broadcaster.subscribe()
        frames = [encode("snapshot", self.sidecar.snapshot_wire(), broadcaster.next_seq())]
        membership = self.sidecar.topology.current
        if membership is not None:
            frames.append(encode("membership", membership, broadcaster.next_seq()))
        try:
            await resp.write(b"".join(frames))
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self.keepalive)
                except TimeoutError:
                    await resp.write(KEEPALIVE)
                    continue
                if item is CUT_OFF:
                    log.warning("stream reader fell behind; disconnected it (it will get a fresh snapshot)")
                    break
                if item is CLOSED:
                    break
                await resp.write(encode(item.event, item.data, item.seq))
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            broadcaster.unsubscribe(queue)
        return resp

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: encode them back.
        supplied = token.strip().encode("utf-8", "surrogateescape")
        return hmac.compare_digest(supplied, self.sidecar.token.encode())

    async def hooks(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (see SPOTGUARD_TOKEN_FILE)",
                          **{"WWW-Authenticate": "Bearer"})
        try:
            report = HookReport.from_wire(await read_json(request, MAX_BODY, self.body_timeout))
        except BodyError as exc:
            return _error(exc.status, exc.message)
        except HookFormatError as exc:
            return _error(400, str(exc))
        progress = self.sidecar.record_hook(report)
        return web.json_response({"v": 1, "accepted": True, **progress.to_wire(), "complete": progress.complete})

    async def prestop(self, request: web.Request) -> web.Response:
        raw = request.query.get("timeout")
        timeout = DEFAULT_PRESTOP_TIMEOUT
        if raw is not None:
            try:
                timeout = float(raw)
            except ValueError:
                return _error(400, f"timeout: expected seconds, got {raw!r:.40}")
            if not 0 < timeout <= MAX_PRESTOP_TIMEOUT:
                return _error(400, f"timeout: must be > 0 and <= {MAX_PRESTOP_TIMEOUT:g}, got {raw!r:.40}")
        sc = self.sidecar
        result = await wait_for_pod(sc.live, sc.book, sc.pulse, timeout)
        log.info("prestop: %s after %.2fs (notice %s)", result.outcome, result.waited, result.notice_id)
        return web.json_response(result.to_wire())
