"""Emulated EC2 instance metadata (IMDS): IMDSv2 tokens, spot, rebalance, maintenance, ASG.

Options: `imdsv1` (default True) lets GETs without a token through, as instances that still
allow IMDSv1 do; False answers them 401 like an IMDSv2-only instance. `instance_id`: what
meta-data/instance-id serves (default: a random `i-` + 17 hex digits per emulated VM).
Schedule kinds and their fields:
- reclaim: `action` terminate|stop|hibernate (instance-action and termination-time paths);
- rebalance: (noticeTime = flip time);
- maintenance: `code`, `state` active|completed (canceling shows State canceled), `duration`;
- lifecycle: target-lifecycle-state turns Terminated.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar

from aiohttp import web

from spotguard.emulator.clouds.session_tokens import SessionTokens
from spotguard.emulator.clouds.base import CloudHandler, ScheduleError
from spotguard.emulator.clouds.timefmt import aws_maintenance, iso_z

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MD = "/latest/meta-data"
NOT_FOUND_HTML = """<?xml version="1.0" encoding="iso-8859-1"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"
\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">
<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">
 <head>
  <title>404 - Not Found</title>
 </head>
 <body>
  <h1>404 - Not Found</h1>
 </body>
</html>
"""
ACTIONS = ("terminate", "stop", "hibernate")
MAINTENANCE_CODES = ("instance-reboot", "system-reboot", "system-maintenance", "instance-retirement", "instance-stop")


def _not_found() -> web.Response:
    return web.Response(status=404, text=NOT_FOUND_HTML, content_type="text/html")


class Handler(CloudHandler):
    name = "aws"
    kinds = ("reclaim", "rebalance", "maintenance", "lifecycle")
    default_lead: ClassVar[dict[str, float]] = {
        "reclaim": 120.0,
        "rebalance": 600.0,
        "maintenance": 3600.0,
        "lifecycle": 300.0,
    }

    def __init__(self, imdsv1: bool = True, **options: Any) -> None:
        super().__init__(**options)
        self.imdsv1 = imdsv1
        self.session = SessionTokens(TTL_HEADER, TOKEN_HEADER, allow_tokenless=imdsv1)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.put(TOKEN_PATH, self.session.issue),
            web.get(f"{MD}/spot/instance-action", self.session.guard(self._instance_action)),
            web.get(f"{MD}/spot/termination-time", self.session.guard(self._termination_time)),
            web.get(f"{MD}/events/recommendations/rebalance", self.session.guard(self._rebalance)),
            web.get(f"{MD}/events/maintenance/scheduled", self.session.guard(self._maintenance)),
            web.get(f"{MD}/autoscaling/target-lifecycle-state", self.session.guard(self._lifecycle)),
            web.get(f"{MD}/instance-id", self.session.guard(self._instance_id)),
        ]

    def schedule_params(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        if kind == "reclaim":
            action = spec.get("action", "terminate")
            if action not in ACTIONS:
                raise ScheduleError(f"action: expected one of {', '.join(ACTIONS)}, got {action!r}")
            return {"action": action}
        if kind == "maintenance":
            code = spec.get("code", "system-reboot")
            state = spec.get("state", "active")
            duration = spec.get("duration", 1000)
            if code not in MAINTENANCE_CODES:
                raise ScheduleError(f"code: expected one of {', '.join(MAINTENANCE_CODES)}, got {code!r}")
            if state not in ("active", "completed"):
                raise ScheduleError(f"state: expected active or completed, got {state!r}")
            if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration < 0:
                raise ScheduleError(f"duration: expected seconds >= 0, got {duration!r}")
            event_id = spec.get("event_id") or f"instance-event-{secrets.token_hex(8)}"
            return {"code": code, "state": state, "duration": duration, "event_id": str(event_id)}
        return {}

    def expire_tokens(self) -> None:
        self.session.expire()

    def malformed_body(self, path: str) -> bytes:
        return b'[{"NotBefore": 12, "Code": ' if path.endswith("scheduled") else b'{"action": "terminate", "time": '

    # -- metadata paths ------------------------------------------------------------------------

    def _latest(self, kind: str):
        live = [n for n in self.state.visible() if n.kind == kind]
        return live[-1] if live else None

    async def _instance_action(self, request: web.Request) -> web.Response:
        notice = self._latest("reclaim")
        if notice is None:
            return _not_found()
        body = {"action": notice.params["action"], "time": iso_z(notice.deadline)}
        return web.Response(text=json.dumps(body), content_type="text/plain")

    async def _termination_time(self, request: web.Request) -> web.Response:
        notice = self._latest("reclaim")
        if notice is None or notice.params["action"] != "terminate":
            return _not_found()
        return web.Response(text=iso_z(notice.deadline), content_type="text/plain")

    async def _rebalance(self, request: web.Request) -> web.Response:
        notice = self._latest("rebalance")
        if notice is None:
            return _not_found()
        return web.Response(text=json.dumps({"noticeTime": iso_z(notice.served_at)}), content_type="text/plain")

    async def _maintenance(self, request: web.Request) -> web.Response:
        events = []
        for n in self.state.visible(include_canceled=True):
            if n.kind != "maintenance":
                continue
            state = "canceled" if n.canceled_at is not None else n.params["state"]
            events.append({
                "NotBefore": aws_maintenance(n.deadline),
                "Code": n.params["code"],
                "Description": f"scheduled {n.params['code'].replace('-', ' ')}",
                "EventId": n.params["event_id"],
                "NotAfter": aws_maintenance(n.deadline + n.params["duration"]),
                "State": state,
            })
        return web.Response(text=json.dumps(events), content_type="text/plain")

    async def _lifecycle(self, request: web.Request) -> web.Response:
        state = "Terminated" if self._latest("lifecycle") is not None else "InService"
        return web.Response(text=state, content_type="text/plain")

    async def _instance_id(self, request: web.Request) -> web.Response:
        return web.Response(text=self.instance_id, content_type="text/plain")

    @staticmethod
    def new_instance_id() -> str:
        return "i-" + secrets.token_hex(9)[:17]
