"""The emulator's HTTP server: one cloud's metadata paths plus the control API.

Control API (JSON; every call needs `Authorization: Bearer <control token>`, because it
changes what the emulated cloud says; the token is random unless given):
- POST   /_emulator/notices         {"kind", "in": s, "lead": s, ...cloud fields} -> notice
- GET    /_emulator/notices         -> {"notices": [...]} with scheduled and served times
- DELETE /_emulator/notices/{id}    cancel (a maintenance shows as canceled where the cloud does)
- POST   /_emulator/faults          {"kind", "path", "count", "seconds", "status", "bytes", "retry_after"}
- DELETE /_emulator/faults          clear all faults
- POST   /_emulator/reset           drop every notice and fault
- GET    /_emulator/instance        -> {"instance_id": ...} the emulated VM's id
- POST   /_emulator/instance        {"instance_id": optional} the VM is re-created under the same
                                    name: a new instance id (given, else random); notices and
                                    faults stay (reset for a fresh VM) -> {"instance_id": ...}
- GET    /_emulator/requests        -> {"total": n, "by_path": {...}} cloud requests served
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import secrets
from typing import Any

from aiohttp import web

from spotguard.emulator.clouds import handler_for
from spotguard.emulator.clouds.base import CloudHandler, ScheduleError
from spotguard.emulator.faults import FaultSpecError, FaultTable
from spotguard.emulator.state import EmulatorState

log = logging.getLogger(__name__)
CONTROL_PREFIX = "/_emulator"
MAX_DELAY = 7 * 86400.0


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Emulator:
    """An emulated cloud VM served over HTTP. Use as `async with Emulator("aws") as emu:`.

    `url` is the metadata base URL (what a source's --metadata-url takes); `control_token`
    authenticates the control API.
    """

    def __init__(self, cloud: str, host: str = "127.0.0.1", port: int = 0,
                 control_token: str | None = None, **cloud_options: Any):
        self.cloud = cloud
        self.host, self.port = host, port
        self.control_token = control_token or secrets.token_urlsafe(24)
        self.handler: CloudHandler = handler_for(cloud, **cloud_options)
        self.state = EmulatorState()
        self.faults = FaultTable()
        self.requests: collections.Counter[str] = collections.Counter()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def make_app(self) -> web.Application:
        self.handler.bind(self.state)
        app = web.Application(middlewares=[self._control_auth, self._inject_faults],
                              client_max_size=1 << 20)
        app.add_routes(self.handler.routes())
        app.add_routes([
            web.post(f"{CONTROL_PREFIX}/notices", self._schedule),
            web.get(f"{CONTROL_PREFIX}/notices", self._list),
            web.delete(f"{CONTROL_PREFIX}/notices/{{id}}", self._cancel),
            web.post(f"{CONTROL_PREFIX}/faults", self._add_fault),
            web.delete(f"{CONTROL_PREFIX}/faults", self._clear_faults),
            web.post(f"{CONTROL_PREFIX}/reset", self._reset),
            web.get(f"{CONTROL_PREFIX}/instance", self._instance),
            web.post(f"{CONTROL_PREFIX}/instance", self._replace_instance),
            web.get(f"{CONTROL_PREFIX}/requests", self._request_counts),
        ])
        return app

    async def start(self) -> Emulator:
        self._runner = web.AppRunner(self.make_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.port = sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            self.state.reset()
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Emulator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _control_auth(self, request: web.Request, handler):
        if request.path.startswith(CONTROL_PREFIX):
            supplied = request.headers.get("Authorization", "")
            expected = f"Bearer {self.control_token}"
            if not hmac.compare_digest(supplied.encode(), expected.encode()):
                return _json_error(401, "control API: missing or wrong bearer token")
        return await handler(request)

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler):
        if request.path.startswith(CONTROL_PREFIX):
            return await handler(request)
        self.requests[request.path] += 1
        rule = self.faults.take(request.path)
        if rule is None:
            return await handler(request)
        if rule.kind == "latency":
            await asyncio.sleep(rule.seconds)
            return await handler(request)
        if rule.kind == "hang":
            await asyncio.sleep(rule.seconds)
            return _json_error(504, "hung")
        if rule.kind == "status":
            headers = {} if rule.retry_after is None else {"Retry-After": str(rule.retry_after)}
            return web.Response(status=rule.status, text=f"emulated status {rule.status}", headers=headers)
        if rule.kind == "malformed":
            return web.Response(status=200, body=self.handler.malformed_body(request.path),
                                headers=self._cloud_headers())
        if rule.kind == "oversized":
            return web.Response(status=200, body=b"x" * rule.size, headers=self._cloud_headers())
        if rule.kind == "drop":
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError()
        if rule.kind == "expired-token":
            self.handler.expire_tokens()
            return await handler(request)
        return await handler(request)

    def _cloud_headers(self) -> dict[str, str]:
        return {"Metadata-Flavor": "Google", "ETag": "corrupt"} if self.cloud == "gcp" else {}

    # -- control routes ----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError):
            raise web.HTTPBadRequest(text=json.dumps({"error": "body: not JSON"}),
                                     content_type="application/json") from None

    async def _schedule(self, request: web.Request) -> web.Response:
        spec = await self._body(request)
        if not isinstance(spec, dict):
            return _json_error(400, "body: expected a JSON object")
        kind = spec.get("kind")
        if kind not in self.handler.kinds:
            return _json_error(400, f"kind: {self.cloud} shows {', '.join(self.handler.kinds)}, not {kind!r}")
        try:
            delay = _seconds(spec, "in", 0.0)
            lead = _seconds(spec, "lead", self.handler.default_lead.get(kind, 120.0))
            params = self.handler.schedule_params(kind, spec)
        except ScheduleError as exc:
            return _json_error(400, str(exc))
        notice = self.state.schedule(kind, delay, lead, params)
        return web.json_response(notice.describe(), status=201)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"notices": [n.describe() for n in self.state.notices.values()]})

    async def _cancel(self, request: web.Request) -> web.Response:
        try:
            notice = self.state.cancel(request.match_info["id"])
        except KeyError:
            return _json_error(404, f"no notice {request.match_info['id']!r}")
        return web.json_response(notice.describe())

    async def _add_fault(self, request: web.Request) -> web.Response:
        try:
            rule = self.faults.add(await self._body(request))
        except FaultSpecError as exc:
            return _json_error(400, str(exc))
        return web.json_response(rule.describe(), status=201)

    async def _clear_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return web.json_response({"faults": []})

    async def _reset(self, request: web.Request) -> web.Response:
        self.faults.clear()
        self.state.reset()
        self.requests.clear()
        return web.json_response({"reset": True})

    async def _instance(self, request: web.Request) -> web.Response:
        return web.json_response({"instance_id": self.handler.instance_id})

    async def _replace_instance(self, request: web.Request) -> web.Response:
        spec = await self._body(request) if request.can_read_body else {}
        if not isinstance(spec, dict):
            return _json_error(400, "body: expected a JSON object")
        try:
            instance_id = self.handler.replace_instance(spec.get("instance_id"))
        except ScheduleError as exc:
            return _json_error(400, str(exc))
        return web.json_response({"instance_id": instance_id})

    async def _request_counts(self, request: web.Request) -> web.Response:
        return web.json_response({"total": sum(self.requests.values()), "by_path": dict(self.requests)})


def _seconds(spec: dict, key: str, default: float) -> float:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_DELAY:
        raise ScheduleError(f"{key}: expected seconds in [0, {MAX_DELAY:.0f}], got {value!r}")
    return float(value)
