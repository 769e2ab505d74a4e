"""Emulated Azure Instance Metadata Service: Scheduled Events and the VM's name.

Paths: GET/POST /metadata/scheduledevents?api-version=2020-07-01,
GET /metadata/instance/compute/name?api-version=2021-02-01&format=text and
GET /metadata/instance/compute/vmId?api-version=2021-02-01&format=text (the VM's unique id, a
UUID: option `instance_id`, default a random one per emulated VM).

Like IMDS: every request needs `Metadata: true`, no `X-Forwarded-For` and an `api-version`
(400 otherwise); the name is a leaf, served with `format=text` only. More than `rate_limit`
requests (default 5) within one second get 429; rejected requests do not count against the
limit. `throttled` counts the 429s sent.

The events document is `{"DocumentIncarnation": n, "Events": [...]}`; n goes up by one whenever
the document's content changes. An event is `Scheduled` with `NotBefore` = its deadline (RFC
1123) until the deadline passes or it is approved, then `Started` with an empty `NotBefore`.
Approval (POST `{"StartRequests": [{"EventId": ...}]}`, unknown ids ignored, 200 with an empty
body) starts an event at once; it then disappears after `started_seconds` (default 1 s; 0: at
once), as the platform finishes it. Canceling a notice through the control API removes it.

Options: `vm_name` (default vmss_vm_1), `rate_limit` (requests/s, 0 = none), `started_seconds`.
Schedule kinds: `event` (fields `event_type` Freeze|Reboot|Redeploy|Preempt|Terminate, default
Preempt; `resources`, default [this VM's name]; `status` Scheduled|Started; optional `event_id`,
`duration`, `event_source`, `description`; lead defaults to 30 s whatever the type, pass `lead`
for a longer one), `reclaim` (an `event` of type Preempt) and `maintenance` (type Reboot, lead
900 s), both taking the same fields.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from typing import Any, ClassVar

from aiohttp import web

from spotguard.emulator.clouds.base import CloudHandler, ScheduleError
from spotguard.emulator.clouds.timefmt import rfc1123

EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"
VM_ID_PATH = "/metadata/instance/compute/vmId"
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
STATUSES = ("Scheduled", "Started")
KIND_TYPES = {"reclaim": "Preempt", "maintenance": "Reboot"}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Handler(CloudHandler):
    name = "azure"
    kinds = ("event", "reclaim", "maintenance")
    default_lead: ClassVar[dict[str, float]] = {"event": 30.0, "reclaim": 30.0, "maintenance": 900.0}

    def __init__(self, vm_name: str = "vmss_vm_1", rate_limit: float = 5.0, started_seconds: float = 1.0,
                 **options: Any) -> None:
        super().__init__(**options)
        self.vm_name = vm_name
        self.rate_limit = rate_limit
        self.started_seconds = started_seconds
        self.throttled = 0
        self.approvals: list[str] = []  # EventIds approved, in order
        self._served: collections.deque[float] = collections.deque()
        self._incarnation = 1
        self._last_events: list[dict] = []

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(EVENTS_PATH, self._guard(self._events)),
            web.post(EVENTS_PATH, self._guard(self._approve)),
            web.get(NAME_PATH, self._guard(self._name)),
            web.get(VM_ID_PATH, self._guard(self._vm_id)),
        ]

    @staticmethod
    def new_instance_id() -> str:
        return str(uuid.uuid4())

    def schedule_params(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        event_type = spec.get("event_type", KIND_TYPES.get(kind, "Preempt"))
        if event_type not in EVENT_TYPES:
            raise ScheduleError(f"event_type: expected one of {', '.join(EVENT_TYPES)}, got {event_type!r}")
        resources = spec.get("resources", [self.vm_name])
        if not isinstance(resources, list) or not all(isinstance(r, str) and r for r in resources):
            raise ScheduleError(f"resources: expected a list of VM names, got {resources!r}")
        status = spec.get("status", "Scheduled")
        if status not in STATUSES:
            raise ScheduleError(f"status: expected Scheduled or Started, got {status!r}")
        duration = spec.get("duration", -1 if event_type == "Preempt" else 0)
        if isinstance(duration, bool) or not isinstance(duration, int):
            raise ScheduleError(f"duration: expected whole seconds, got {duration!r}")
        event_source = spec.get("event_source", "Platform")
        if event_source not in ("Platform", "User"):
            raise ScheduleError(f"event_source: expected Platform or User, got {event_source!r}")
        description = spec.get("description", f"Virtual machine is being {event_type.lower()}ed.")
        if not isinstance(description, str):
            raise ScheduleError("description: expected a string")
        event_id = spec.get("event_id") or str(uuid.uuid4())
        if not isinstance(event_id, str):
            raise ScheduleError(f"event_id: expected a string, got {event_id!r}")
        return {"event_type": event_type, "resources": resources, "status": status, "duration": duration,
                "event_source": event_source, "description": description, "event_id": event_id,
                "approved_at": None}

    def malformed_body(self, path: str) -> bytes:
        return b'{"DocumentIncarnation": 7, "Events": [{"EventId": "' if path == EVENTS_PATH else b'{"name": '

    # -- request checks ------------------------------------------------------------------------

    def _guard(self, handler):
        async def guarded(request: web.Request) -> web.Response:
            if self._throttle():
                self.throttled += 1
                return _error(429, "Too many requests")
            if request.headers.get("Metadata", "").lower() != "true":
                return _error(400, "Bad request. Required metadata header not specified")
            if "X-Forwarded-For" in request.headers:
                return _error(400, "Bad request. Request cannot contain X-Forwarded-For header")
            if not request.query.get("api-version"):
                return _error(400, "Bad request. api-version was not specified in the request")
            return await handler(request)
        return guarded

    def _throttle(self) -> bool:
        """True when this request would exceed `rate_limit` within the last second."""
        if not self.rate_limit:
            return False
        now = time.monotonic()
        while self._served and now - self._served[0] >= 1.0:
            self._served.popleft()
        if len(self._served) >= self.rate_limit:
            return True
        self._served.append(now)
        return False

    # -- documents -----------------------------------------------------------------------------

    def _event(self, notice) -> dict[str, Any]:
        p = notice.params
        started = p["status"] == "Started" or p["approved_at"] is not None or time.time() >= notice.deadline
        return {
            "EventId": p["event_id"],
            "EventType": p["event_type"],
            "ResourceType": "VirtualMachine",
            "Resources": list(p["resources"]),
            "EventStatus": "Started" if started else "Scheduled",
            "NotBefore": "" if started else rfc1123(notice.deadline),
            "Description": p["description"],
            "EventSource": p["event_source"],
            "DurationInSeconds": p["duration"],
        }

    def document(self) -> dict[str, Any]:
        """The scheduled-events document now (DocumentIncarnation bumps on each change)."""
        events = [self._event(n) for n in self.state.visible() if n.kind in self.kinds]
        if events != self._last_events:
            self._incarnation += 1
            self._last_events = events
        return {"DocumentIncarnation": self._incarnation, "Events": events}

    async def _events(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.document()), content_type="application/json")

    async def _approve(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "Bad request. Body is not JSON")
        starts = body.get("StartRequests") if isinstance(body, dict) else None
        if not isinstance(starts, list) or not all(isinstance(s, dict) and isinstance(s.get("EventId"), str)
                                                   for s in starts):
            return _error(400, 'Bad request. Expected {"StartRequests": [{"EventId": "..."}]}')
        wanted = {s["EventId"] for s in starts}
        loop = asyncio.get_running_loop()
        for notice in self.state.visible():
            if notice.kind in self.kinds and notice.params["event_id"] in wanted \
                    and notice.params["approved_at"] is None:
                notice.params["approved_at"] = time.time()
                self.approvals.append(notice.params["event_id"])
                loop.call_later(self.started_seconds, self._finish, notice.id)
        return web.Response(status=200, body=b"")

    def _finish(self, notice_id: str) -> None:
        if notice_id in self.state.notices:
            self.state.cancel(notice_id)

    async def _name(self, request: web.Request) -> web.Response:
        return self._leaf(request, self.vm_name)

    async def _vm_id(self, request: web.Request) -> web.Response:
        return self._leaf(request, self.instance_id)

    @staticmethod
    def _leaf(request: web.Request, value: str) -> web.Response:
        if request.query.get("format") != "text":
            return _error(400, "Bad request. Leaf node values are only served with format=text")
        return web.Response(text=value, content_type="text/plain")
