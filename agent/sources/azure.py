"""Azure notice source: Scheduled Events, with early approval for the agent.

`ScheduledEventsSource` (azure.events) polls /metadata/scheduledevents (default every 1 s) and
yields one notice per event whose `Resources` name this VM (events are broadcast to the whole
availability set or scale-set placement group):
- Preempt -> reclaim; Terminate -> reclaim: the VM is deleted (scale-in, user delete) and the
  node goes away at NotBefore exactly as with a reclaim, so the job must checkpoint against that
  deadline; `drain` is kept for the cluster removing a node, with no cloud deadline;
- Reboot, Redeploy, Freeze -> maintenance;
- an EventType this code does not know is skipped (counted in `skipped_types`), not guessed at.
The deadline is NotBefore; when NotBefore is empty or the event has Started, it is the moment
the source first saw it that way (kept across reads). The id comes from the VM's id
(/metadata/instance/compute/vmId, read once: `instance.py`) and EventId, so a VM re-created
under the same name gives new ids.

The VM's name is read once from /metadata/instance/compute/name (retried on the next poll until
it succeeds) unless given. `DocumentIncarnation` is tracked in `incarnation`; a document is
parsed in full on every read, so no change is ever missed.

All requests (polls, the name, the VM id, approvals) share one `RateLimiter`: at most 5 within any second
(IMDS answers 429 beyond that). `approve(event_id)` POSTs StartRequests; call it only once the
checkpoint is durable, since approving lets the platform act at once.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, UTC
from collections.abc import Mapping
from typing import Any

from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.http import MetadataClient, Response, expect_status, parse_text_leaf
from spotguard.agent.sources.instance import UUID, FALLBACK, InstanceIdentity, InstancePin, parse_instance_id
from spotguard.wire.notice import Kind, Notice, notice_id, now_utc

log = logging.getLogger(__name__)

DEFAULT_URL = "http://169.254.169.254"
EVENTS_PATH = "/metadata/scheduledevents"
EVENTS_API = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
NAME_API = "2021-02-01"
VM_ID_PATH = "/metadata/instance/compute/vmId"
HEADERS = {"Metadata": "true"}
MIN_INTERVAL = 0.25
EVENT_KINDS = {"Preempt": Kind.RECLAIM, "Terminate": Kind.RECLAIM, "Reboot": Kind.MAINTENANCE,
               "Redeploy": Kind.MAINTENANCE, "Freeze": Kind.MAINTENANCE}
STATUSES = ("Scheduled", "Started")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_RFC1123 = re.compile(r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), (\d{1,2}) (" + "|".join(_MONTHS)
                      + r") (\d{4}) (\d{2}):(\d{2}):(\d{2}) GMT")
_VM_NAME = re.compile(r"[\x21-\x7e]{1,256}")


class RateLimiter:
    """Lets at most `rate` acquisitions through within any `per` seconds (+ `margin`, for the
    server's clock and transit); callers wait their turn in order."""

    def __init__(self, rate: int = 5, per: float = 1.0, margin: float = 0.1):
        if rate < 1 or per <= 0 or margin < 0:
            raise ValueError("rate limiter needs rate >= 1, per > 0, margin >= 0")
        self.rate, self.window = rate, per + margin
        self.sent: collections.deque[float] = collections.deque(maxlen=1000)  # monotonic send times
        self._recent: collections.deque[float] = collections.deque()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                while self._recent and now - self._recent[0] >= self.window:
                    self._recent.popleft()
                if len(self._recent) < self.rate:
                    self._recent.append(now)
                    self.sent.append(now)
                    return
                await asyncio.sleep(self.window - (now - self._recent[0]))


def parse_rfc1123(value: str, field_name: str) -> datetime:
    """'Mon, 19 Sep 2016 18:29:47 GMT' -> aware UTC datetime; SourceError otherwise."""
    match = _RFC1123.fullmatch(value.strip())
    if match is None:
        raise SourceError("malformed", f"{field_name}: not an RFC 1123 date: {value!r:.60}")
    day, month, year, hour, minute, second = match.groups()
    try:
        return datetime(int(year), _MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second),
                        tzinfo=UTC)
    except ValueError:
        raise SourceError("malformed", f"{field_name}: impossible date {value!r:.60}") from None


@dataclass(frozen=True)
class EventsDocument:
    """One parsed scheduled-events answer: its incarnation, this VM's notices, and how many
    events of unknown type were skipped."""

    incarnation: int
    notices: list[Notice]
    skipped_types: int = 0


def _json(resp: Response, path: str) -> object:
    try:
        return json.loads(resp.text())
    except (ValueError, RecursionError):
        raise SourceError("malformed", f"{path}: body is not JSON") from None


def parse_vm_name(status: int, headers: Mapping[str, str], body: bytes) -> str:
    """The VM name from /metadata/instance/compute/name?format=text; SourceError otherwise."""
    return parse_text_leaf(status, headers, body, path=NAME_PATH, pattern=_VM_NAME, what="a VM name")


def parse_vm_id(status: int, headers: Mapping[str, str], body: bytes) -> str:
    """The VM's unique id (a UUID) from /metadata/instance/compute/vmId?format=text; SourceError
    otherwise."""
    return parse_instance_id(status, headers, body, path=VM_ID_PATH, pattern=UUID).lower()


def parse_scheduled_events(status: int, headers: Mapping[str, str], body: bytes, *, node: str, vm_name: str,
                           now: datetime | None = None, previous: Mapping[str, Notice] | None = None,
                           source: str = "azure.events", instance: str = FALLBACK) -> EventsDocument:
    """Parses a scheduled-events answer into this VM's notices (see the module docstring).

    `previous` (the live notices by id) keeps the deadline of an event without NotBefore from
    the read that first saw it so. Ids hash the node, `instance` (the vmId; FALLBACK when unknown)
    and EventId. Any structural fault in the document raises SourceError: a half-understood
    document never yields notices.
    """
    resp = Response(status, headers, body)
    expect_status(resp, EVENTS_PATH, 200)
    doc = _json(resp, EVENTS_PATH)
    if not isinstance(doc, dict):
        raise SourceError("malformed", f"{EVENTS_PATH}: expected a JSON object")
    incarnation, events = doc.get("DocumentIncarnation"), doc.get("Events")
    if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
        raise SourceError("malformed", f"{EVENTS_PATH}: DocumentIncarnation {incarnation!r:.40}")
    if not isinstance(events, list):
        raise SourceError("malformed", f"{EVENTS_PATH}: Events is not a list")
    detected = now or now_utc()
    mine = vm_name.casefold()
    notices: list[Notice] = []
    skipped = 0
    for i, event in enumerate(events):
        where = f"{EVENTS_PATH}: Events[{i}]"
        if not isinstance(event, dict):
            raise SourceError("malformed", f"{where}: not an object")
        event_id, event_type = event.get("EventId"), event.get("EventType")
        event_status, not_before = event.get("EventStatus"), event.get("NotBefore", "")
        resources = event.get("Resources")
        if not isinstance(event_id, str) or not 0 < len(event_id) <= 256:
            raise SourceError("malformed", f"{where}.EventId: {event_id!r:.60}")
        if not isinstance(event_type, str):
            raise SourceError("malformed", f"{where}.EventType: {event_type!r:.40}")
        if not isinstance(event_status, str) or event_status not in STATUSES:
            raise SourceError("malformed", f"{where}.EventStatus: {event_status!r:.40}")
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            raise SourceError("malformed", f"{where}.Resources: expected a list of names")
        if not isinstance(not_before, str):
            raise SourceError("malformed", f"{where}.NotBefore: {not_before!r:.60}")
        deadline = parse_rfc1123(not_before, f"{where}.NotBefore") if not_before.strip() else None
        if mine not in (r.casefold() for r in resources):
            continue
        kind = EVENT_KINDS.get(event_type)
        if kind is None:
            skipped += 1
            continue
        nid = notice_id(source, node, instance, event_id)
        if deadline is None or event_status == "Started":
            earlier = (previous or {}).get(nid)
            if earlier is not None and earlier.detail.get("EventStatus") == event_status \
                    and not earlier.detail.get("NotBefore"):
                deadline = earlier.deadline
            else:
                deadline = detected
            not_before = ""
        detail: dict[str, Any] = {"EventId": event_id, "EventType": event_type, "EventStatus": event_status,
                  "NotBefore": not_before, "Resources": [r for r in resources if r.casefold() == mine]}
        for key in ("ResourceType", "Description", "EventSource"):
            if isinstance(event.get(key), str):
                detail[key] = event[key]
        duration = event.get("DurationInSeconds")
        if isinstance(duration, int) and not isinstance(duration, bool):
            detail["DurationInSeconds"] = duration
        notices.append(Notice(id=nid, kind=kind, source=source, node=node, detected_at=detected,
                              deadline=deadline, detail=detail))
    return EventsDocument(incarnation, notices, skipped)


class AzureImdsClient:
    """Scheduled Events over IMDS: every request sends `Metadata: true` and waits its turn in
    one `RateLimiter`, so polls and approvals together stay within the service's 5/s."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout: float = 2.0, limiter: RateLimiter | None = None):
        self.http = MetadataClient(base_url, timeout=timeout)
        self.limiter = limiter or RateLimiter()

    async def request(self, method: str, path: str, params: Mapping[str, str],
                      json_body: object = None) -> Response:
        await self.limiter.acquire()
        return await self.http.request(method, path, headers=HEADERS, params=params, json_body=json_body)

    async def vm_name(self) -> str:
        resp = await self.request("GET", NAME_PATH, {"api-version": NAME_API, "format": "text"})
        return parse_vm_name(resp.status, resp.headers, resp.body)

    async def vm_id(self) -> str:
        resp = await self.request("GET", VM_ID_PATH, {"api-version": NAME_API, "format": "text"})
        return parse_vm_id(resp.status, resp.headers, resp.body)

    async def events(self) -> Response:
        return await self.request("GET", EVENTS_PATH, {"api-version": EVENTS_API})

    async def approve(self, event_id: str, attempts: int = 3) -> None:
        """POSTs StartRequests for `event_id`; retries a 429 (after a pause) up to `attempts`
        times in all. SourceError when the service does not accept it."""
        for attempt in range(attempts):
            resp = await self.request("POST", EVENTS_PATH, {"api-version": EVENTS_API},
                                      json_body={"StartRequests": [{"EventId": event_id}]})
            if resp.status == 429 and attempt + 1 < attempts:
                await asyncio.sleep(self.limiter.window / self.limiter.rate)
                continue
            expect_status(resp, EVENTS_PATH, 200, 201, 202, 204)
            return

    async def close(self) -> None:
        await self.http.close()


class ScheduledEventsSource(Source):
    name = "azure.events"

    def __init__(self, client: AzureImdsClient, node: str, interval: float = 1.0, vm_name: str | None = None,
                 owns_client: bool = True):
        super().__init__(node, interval)
        self.client = client
        self.vm_name = vm_name
        self.instance = InstancePin(InstanceIdentity(client.vm_id, "Azure compute/vmId"), self.stats.errors)
        self.incarnation: int | None = None
        self.skipped_types = 0
        self._owns_client = owns_client

    async def poll(self) -> list[Notice]:
        self.instance.prefetch()
        if self.vm_name is None:
            try:
                self.vm_name = await self.client.vm_name()
            except SourceError as exc:
                raise SourceError("vm_name", f"cannot read this VM's name: {exc}") from None
            log.info("azure: this VM is %s", self.vm_name)
        resp = await self.client.events()
        vm_name = self.vm_name
        doc = await self.instance.identify(
            lambda instance: parse_scheduled_events(resp.status, resp.headers, resp.body, node=self.node,
                                                    vm_name=vm_name, previous=self._live, source=self.name,
                                                    instance=instance),
            has_live=bool(self._live), shows=lambda parsed: parsed.notices)
        if self.incarnation is not None and doc.incarnation < self.incarnation:
            log.info("azure: DocumentIncarnation went back from %s to %s (service restarted)",
                     self.incarnation, doc.incarnation)
        self.incarnation = doc.incarnation
        self.skipped_types += doc.skipped_types
        return doc.notices

    async def approve(self, event_id: str) -> None:
        """Approves an event early. `event_id` is Azure's EventId or the id of a live notice of
        this source. Raises SourceError when the service refuses or cannot be reached."""
        live = self._live.get(event_id)
        if live is not None:
            event_id = live.detail["EventId"]
        await self.client.approve(event_id)

    async def close(self) -> None:
        await self.instance.close()
        if self._owns_client:
            await self.client.close()


def azure_sources(node: str, base_url: str = DEFAULT_URL, interval: float = 1.0, timeout: float = 2.0,
                  vm_name: str | None = None) -> list[Source]:
    """The Azure monitor for one node. `vm_name` overrides the name read from IMDS. An interval
    below MIN_INTERVAL is raised to it: IMDS allows 5 requests/s, and approvals need room."""
    interval = max(interval, MIN_INTERVAL)
    return [ScheduledEventsSource(AzureImdsClient(base_url, timeout=timeout), node, interval, vm_name=vm_name)]
