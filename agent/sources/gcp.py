"""GCP notice sources: preemption and host maintenance, watched with hanging GETs.

One monitor per metadata path, both sharing one `MetadataClient`:
- `PreemptedSource` (gcp.preempted): instance/preempted TRUE -> reclaim, deadline = first
  detection + `preempt_lead` (30 s: GCP gives no time, only the soft-off 30 s later);
- `MaintenanceEventSource` (gcp.maintenance): instance/maintenance-event other than NONE ->
  maintenance, deadline = first detection + `maintenance_lead` (60 s); withdrawn on NONE.

Each loop is a hanging GET (`wait_for_change=true&last_etag=<etag>&timeout_sec=<wait>`) with
interval 0: the server answers as soon as the value changes, so detection costs one round trip.
The first read (and any read before one succeeded) is a plain GET. The ETag kept is always the
last one of a clean answer, so a change that happens while a read fails is seen at once by the
next read. A response without `Metadata-Flavor: Google` is not from the metadata server
(SourceError "flavor"), whatever it says.

The notice id is derived from the node, the instance (`instance/id`, read once and shared by
both monitors: `instance.py`) and the ETag of the value that raised it, so every read and every
restarted agent gives the same id for the same value on the same VM, and a VM re-created under
the same name (a managed instance group) gives a new one although the ETag is the same. (The
metadata server's ETag is a hash of the content; a later maintenance event with the same value
on the same VM therefore reuses the id of a withdrawn one.) The deadline of a live notice is
kept from its first detection; a restarted agent can only date it from its own first read.
"""
from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime, timedelta
from collections.abc import Mapping

from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.http import MetadataClient, Response, expect_status, header
from spotguard.agent.sources.instance import FALLBACK, InstanceIdentity, InstancePin, parse_instance_id
from spotguard.wire.notice import Kind, Notice, notice_id, now_utc

DEFAULT_URL = "http://metadata.google.internal"
PREFIX = "/computeMetadata/v1/instance"
PREEMPTED_PATH = f"{PREFIX}/preempted"
MAINTENANCE_PATH = f"{PREFIX}/maintenance-event"
INSTANCE_ID_PATH = f"{PREFIX}/id"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
PREEMPTED_VALUES = ("TRUE", "FALSE")
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
PREEMPT_LEAD = 30.0
MAINTENANCE_LEAD = 60.0
_ETAG = re.compile(r"[\x21-\x7e]{1,128}")
_INSTANCE_ID = re.compile(r"[0-9]{1,20}")  # a uint64, in decimal


def read_value(status: int, headers: Mapping[str, str], body: bytes, *, path: str,
               allowed: tuple[str, ...]) -> tuple[str, str]:
    """(value, etag) of one metadata answer; SourceError unless it is a 200 from the metadata
    server (Metadata-Flavor: Google), with a sane ETag and one of the `allowed` values."""
    resp = Response(status, headers, body)
    expect_status(resp, path, 200)
    if header(headers, FLAVOR_HEADER) != FLAVOR:
        raise SourceError("flavor", f"{path}: response lacks {FLAVOR_HEADER}: {FLAVOR}")
    etag = header(headers, "ETag")
    if not isinstance(etag, str) or not _ETAG.fullmatch(etag):
        raise SourceError("malformed", f"{path}: missing or bad ETag {etag!r:.40}")
    value = resp.text().strip()
    if value not in allowed:
        raise SourceError("malformed", f"{path}: unexpected value {value!r:.60}")
    return value, etag


def parse_instance_id_answer(status: int, headers: Mapping[str, str], body: bytes) -> str:
    """The VM's id from an instance/id answer; SourceError unless it is a 200 from the metadata
    server (Metadata-Flavor: Google) carrying a decimal id."""
    if status == 200 and header(headers, FLAVOR_HEADER) != FLAVOR:
        raise SourceError("flavor", f"{INSTANCE_ID_PATH}: response lacks {FLAVOR_HEADER}: {FLAVOR}")
    return parse_instance_id(status, headers, body, path=INSTANCE_ID_PATH, pattern=_INSTANCE_ID)


async def read_instance_id(http: MetadataClient) -> str:
    """Reads this VM's id (instance/id)."""
    resp = await http.request("GET", INSTANCE_ID_PATH, headers={FLAVOR_HEADER: FLAVOR})
    return parse_instance_id_answer(resp.status, resp.headers, resp.body)


def instance_identity(http: MetadataClient) -> InstanceIdentity:
    """The VM's id, read through `http`, for the monitors sharing it."""
    return InstanceIdentity(lambda: read_instance_id(http), "GCP instance/id")


def parse_preempted(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                    detected_at: datetime | None = None, lead: float = PREEMPT_LEAD,
                    source: str = "gcp.preempted", instance: str = FALLBACK) -> tuple[str, list[Notice]]:
    """(etag, notices) of an instance/preempted answer: TRUE -> one reclaim notice with
    deadline detected_at + lead and an id from the instance and the ETag; FALSE -> none."""
    value, etag = read_value(status, headers, body, path=PREEMPTED_PATH, allowed=PREEMPTED_VALUES)
    if value != "TRUE":
        return etag, []
    detected = detected_at or now_utc()
    return etag, [Notice(id=notice_id(source, node, instance, etag), kind=Kind.RECLAIM, source=source, node=node,
                         detected_at=detected, deadline=detected + timedelta(seconds=lead),
                         detail={"preempted": value, "etag": etag})]


def parse_maintenance_event(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                            detected_at: datetime | None = None, lead: float = MAINTENANCE_LEAD,
                            source: str = "gcp.maintenance", instance: str = FALLBACK) -> tuple[str, list[Notice]]:
    """(etag, notices) of an instance/maintenance-event answer: a MIGRATE_/TERMINATE_ON_HOST_
    MAINTENANCE value -> one maintenance notice (deadline detected_at + lead, id from the instance
    and the ETag); NONE -> none."""
    value, etag = read_value(status, headers, body, path=MAINTENANCE_PATH, allowed=MAINTENANCE_VALUES)
    if value == "NONE":
        return etag, []
    detected = detected_at or now_utc()
    return etag, [Notice(id=notice_id(source, node, instance, etag), kind=Kind.MAINTENANCE, source=source, node=node,
                         detected_at=detected, deadline=detected + timedelta(seconds=lead),
                         detail={"maintenance-event": value, "etag": etag})]


class _HangingGetSource(Source):
    """Watches one metadata path with hanging GETs; `parse` turns an answer into notices."""

    path = ""
    parse = staticmethod(parse_preempted)

    def __init__(self, http: MetadataClient, node: str, interval: float = 0.0, lead: float = PREEMPT_LEAD,
                 wait_seconds: int = 30, owns_client: bool = False, identity: InstanceIdentity | None = None):
        if not 1 <= wait_seconds <= 3600 or wait_seconds != int(wait_seconds):
            raise ValueError("wait_seconds must be whole seconds within 1..3600")
        super().__init__(node, interval)
        self.http = http
        self.lead = lead
        self.wait_seconds = int(wait_seconds)
        self.etag: str | None = None  # of the last clean answer
        self.instance = InstancePin(identity or instance_identity(http), self.stats.errors)
        self._owns_client = owns_client

    async def poll(self) -> list[Notice]:
        params = None
        timeout = self.http.timeout
        if self.etag is not None:
            params = {"wait_for_change": "true", "last_etag": self.etag, "timeout_sec": str(self.wait_seconds)}
            timeout += self.wait_seconds
        self.instance.prefetch()
        resp = await self.http.request("GET", self.path, headers={FLAVOR_HEADER: FLAVOR}, params=params,
                                       timeout=timeout)
        etag, notices = await self.instance.identify(
            lambda instance: self.parse(resp.status, resp.headers, resp.body, node=self.node, lead=self.lead,
                                        source=self.name, instance=instance),
            has_live=bool(self._live), shows=lambda parsed: parsed[1])
        self.etag = etag
        return [self._first_seen(n) for n in notices]

    def _first_seen(self, notice: Notice) -> Notice:
        """The notice dated from its first detection, so a re-read does not move the deadline."""
        previous = self._live.get(notice.id)
        if previous is None:
            return notice
        return replace(notice, detected_at=previous.detected_at, deadline=previous.deadline)

    async def close(self) -> None:
        await self.instance.close()
        if self._owns_client:
            await self.http.close()


class PreemptedSource(_HangingGetSource):
    name = "gcp.preempted"
    path = PREEMPTED_PATH
    parse = staticmethod(parse_preempted)


class MaintenanceEventSource(_HangingGetSource):
    name = "gcp.maintenance"
    path = MAINTENANCE_PATH
    parse = staticmethod(parse_maintenance_event)


def gcp_sources(node: str, base_url: str = DEFAULT_URL, interval: float = 0.0, timeout: float = 2.0,
                wait_seconds: int = 30, preempt_lead: float = PREEMPT_LEAD,
                maintenance_lead: float = MAINTENANCE_LEAD) -> list[Source]:
    """The GCP monitors for one node, sharing one HTTP client (the first one closes it).

    `interval` is the pause between hanging GETs (0: none); `wait_seconds` (whole seconds) is
    the `timeout_sec` the server may hold each one, and `timeout` bounds a request beyond it.
    Both put the VM's id, read once for the two, in their notice ids."""
    http = MetadataClient(base_url, timeout=timeout)
    identity = instance_identity(http)
    return [
        PreemptedSource(http, node, interval, lead=preempt_lead, wait_seconds=wait_seconds, owns_client=True,
                        identity=identity),
        MaintenanceEventSource(http, node, interval, lead=maintenance_lead, wait_seconds=wait_seconds,
                               identity=identity),
    ]
