"""Emulated Google Compute Engine metadata server: preemption and host maintenance.

Paths under /computeMetadata/v1/instance/: `preempted` (TRUE/FALSE), `maintenance-event`
(NONE / MIGRATE_ON_HOST_MAINTENANCE / TERMINATE_ON_HOST_MAINTENANCE), `scheduling/preemptible`,
`scheduling/on-host-maintenance`, `name`, `id` (the instance id: a random 19-digit number per
emulated VM, or option `instance_id`).

Like the real server: a request without `Metadata-Flavor: Google` (or with `X-Forwarded-For`)
gets 403; every answer carries `Metadata-Flavor: Google` and an `ETag` derived from the path and
the value (the same value always has the same ETag). `?wait_for_change=true&last_etag=E` hangs
until the value's ETag differs from E (at once if it already does; without last_etag, until the
next change), or until `timeout_sec` (default 300, at most 3600) passes, then answers the
current value.

Options: `preemptible` (default True) for scheduling/preemptible.
Schedule kinds and their fields:
- reclaim: `preempted` turns TRUE (default lead 30 s); canceling turns it back to FALSE;
- maintenance: `event` MIGRATE_ON_HOST_MAINTENANCE (default) | TERMINATE_ON_HOST_MAINTENANCE
  (default lead 60 s); canceling turns the value back to NONE.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any, ClassVar
from collections.abc import Callable

from aiohttp import web

from spotguard.emulator.clouds.base import CloudHandler, ScheduleError

PREFIX = "/computeMetadata/v1/instance"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
MAINTENANCE_EVENTS = ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
DEFAULT_WAIT = 300.0
MAX_WAIT = 3600.0


def value_etag(path: str, value: str) -> str:
    """The ETag of `value` at `path`: a hash, so equal values always share an ETag."""
    return hashlib.sha256(f"{path}\0{value}".encode()).hexdigest()[:16]


class Handler(CloudHandler):
    name = "gcp"
    kinds = ("reclaim", "maintenance")
    default_lead: ClassVar[dict[str, float]] = {"reclaim": 30.0, "maintenance": 60.0}
    vm_name = "gke-pool-1-vm-0"

    def __init__(self, preemptible: bool = True, **options: Any) -> None:
        super().__init__(**options)
        self.preemptible = preemptible
        self._values: dict[str, Callable[[], str]] = {
            f"{PREFIX}/preempted": self._preempted,
            f"{PREFIX}/maintenance-event": self._maintenance_event,
            f"{PREFIX}/scheduling/preemptible": lambda: "TRUE" if self.preemptible else "FALSE",
            f"{PREFIX}/scheduling/on-host-maintenance": lambda: "TERMINATE" if self.preemptible else "MIGRATE",
            f"{PREFIX}/name": lambda: self.vm_name,
            f"{PREFIX}/id": lambda: self.instance_id,
        }

    def routes(self) -> list[web.RouteDef]:
        return [web.get(path, self._serve) for path in self._values]

    @staticmethod
    def new_instance_id() -> str:
        return str(10**18 + secrets.randbelow(9 * 10**18))

    def schedule_params(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        if kind == "maintenance":
            event = spec.get("event", MAINTENANCE_EVENTS[0])
            if event not in MAINTENANCE_EVENTS:
                raise ScheduleError(f"event: expected one of {', '.join(MAINTENANCE_EVENTS)}, got {event!r}")
            return {"event": event}
        return {}

    def malformed_body(self, path: str) -> bytes:
        return b"MIGRATE_ON_HOST_MAINTEN" if path.endswith("maintenance-event") else b"TR\x00UE"

    # -- values --------------------------------------------------------------------------------

    def _latest(self, kind: str):
        live = [n for n in self.state.visible() if n.kind == kind]
        return live[-1] if live else None

    def _preempted(self) -> str:
        return "TRUE" if self._latest("reclaim") is not None else "FALSE"

    def _maintenance_event(self) -> str:
        notice = self._latest("maintenance")
        return "NONE" if notice is None else notice.params["event"]

    # -- serving -------------------------------------------------------------------------------

    async def _serve(self, request: web.Request) -> web.Response:
        if request.headers.get(FLAVOR_HEADER) != FLAVOR or "X-Forwarded-For" in request.headers:
            return web.Response(status=403, text="Forbidden: missing Metadata-Flavor: Google",
                                headers={FLAVOR_HEADER: FLAVOR})
        path = request.path
        value_of = self._values[path]
        query = request.query
        if query.get("wait_for_change", "false").lower() == "true":
            try:
                wait = float(query.get("timeout_sec", DEFAULT_WAIT))
            except ValueError:
                return web.Response(status=400, text="timeout_sec: not a number", headers={FLAVOR_HEADER: FLAVOR})
            if not 0 < wait <= MAX_WAIT:
                return web.Response(status=400, text="timeout_sec: out of range", headers={FLAVOR_HEADER: FLAVOR})
            last = query.get("last_etag") or value_etag(path, value_of())
            await self._wait_until_differs(path, value_of, last, wait)
        value = value_of()
        return web.Response(text=value, content_type="application/text",
                            headers={FLAVOR_HEADER: FLAVOR, "ETag": value_etag(path, value)})

    async def _wait_until_differs(self, path: str, value_of: Callable[[], str], last_etag: str,
                                  wait: float) -> None:
        """Returns once the ETag of the value at `path` is not `last_etag`, or after `wait` s."""
        end = time.monotonic() + wait
        while value_etag(path, value_of()) == last_etag:
            left = end - time.monotonic()
            if left <= 0:
                return
            await self.state.wait_for_change(self.state.version, left)
