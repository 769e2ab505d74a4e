"""AWS EC2 notice sources: spot interruption, rebalance, scheduled maintenance, ASG lifecycle.

One small monitor per IMDS path, all sharing one `ImdsClient` (and so one IMDSv2 token):
- `SpotInterruptionSource` (aws.spot): spot/instance-action -> reclaim, deadline = `time`;
- `RebalanceSource` (aws.rebalance): events/recommendations/rebalance -> rebalance, no deadline;
- `MaintenanceSource` (aws.maintenance): events/maintenance/scheduled -> one maintenance notice
  per active event, deadline = NotBefore; canceled and completed events are withdrawn;
- `LifecycleSource` (aws.asg): autoscaling/target-lifecycle-state Terminated -> drain.
Each path's answer is parsed by a pure function `parse_*(status, headers, body, node=...)`
that returns the notices or raises SourceError (fuzzed by tests/test_parsers_property.py).
Every notice id starts with the instance's `instance-id` (read once through the shared client,
with its token: `instance.py`), so a re-created instance of the same name gives new ids.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime, UTC
from collections.abc import Mapping

from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.http import Response, expect_status
from spotguard.agent.sources.instance import FALLBACK, InstanceIdentity, InstancePin
from spotguard.agent.sources.session_token import SessionTokenClient
from spotguard.wire.notice import Kind, Notice, NoticeFormatError, notice_id, now_utc, parse_time

log = logging.getLogger(__name__)

DEFAULT_URL = "http://169.254.169.254"
MD = "/latest/meta-data"
TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_ACTIONS = ("terminate", "stop", "hibernate")
INSTANCE_ID_PATH = f"{MD}/instance-id"
_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")


class ImdsClient(SessionTokenClient):
    """IMDS with IMDSv2 session tokens, falling back to IMDSv1 when no token can be had."""

    token_path = TOKEN_PATH
    ttl_header = TTL_HEADER
    token_header = TOKEN_HEADER
    default_url = DEFAULT_URL
    label = "IMDSv2"

    @property
    def mode(self) -> str:
        """"v2" with a session token, "v1" while falling back to tokenless IMDSv1."""
        return "v1" if self.tokenless else "v2"
    instance_id_path = INSTANCE_ID_PATH
    instance_id_pattern = _INSTANCE_ID


def json_body(resp: Response, path: str):
    """The body parsed as JSON; SourceError("malformed") for anything else (including nesting
    too deep for the parser)."""
    try:
        return json.loads(resp.text())
    except (ValueError, RecursionError):
        raise SourceError("malformed", f"{path}: body is not JSON") from None


_json_body = json_body  # the former private name


def parse_maintenance_time(value: object, field_name: str) -> datetime:
    """Parses AWS maintenance dates such as '21 Jan 2019 09:00:43 GMT'."""
    if not isinstance(value, str) or len(value) > 64:
        raise SourceError("malformed", f"{field_name}: expected a date string")
    for fmt in ("%d %b %Y %H:%M:%S GMT", "%a, %d %b %Y %H:%M:%S GMT"):
        try:
            return datetime.strptime(value.strip(), fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise SourceError("malformed", f"{field_name}: not an RFC 1123 date: {value!r:.60}")


# -- pure parsers: (status, headers, body) -> notices, or SourceError --------------------------
# Each takes one HTTP answer of its path and returns the notices it shows (empty on 404);
# anything else (other status, corrupt or unexpected body) raises SourceError. No I/O. Ids hash
# the node, `instance` (the instance-id; FALLBACK when unknown) and the event's fields.

SPOT_PATH = f"{MD}/spot/instance-action"
REBALANCE_PATH = f"{MD}/events/recommendations/rebalance"
MAINTENANCE_PATH = f"{MD}/events/maintenance/scheduled"
LIFECYCLE_PATH = f"{MD}/autoscaling/target-lifecycle-state"
LIFECYCLE_STATES = ("InService", "Terminated", "Standby", "Warmed:Terminated", "Warmed:Stopped",
                    "Warmed:Running", "Warmed:Hibernated", "Detached")


def parse_instance_action(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                          source: str = "aws.spot", now: datetime | None = None,
                          instance: str = FALLBACK) -> list[Notice]:
    """spot/instance-action -> one reclaim notice, deadline = `time`, id from action + time."""
    resp, path = Response(status, headers, body), SPOT_PATH
    if resp.status == 404:
        return []
    expect_status(resp, path, 200)
    doc = json_body(resp, path)
    if not isinstance(doc, dict):
        raise SourceError("malformed", f"{path}: expected a JSON object")
    action = doc.get("action")
    if not isinstance(action, str) or action not in SPOT_ACTIONS:
        raise SourceError("malformed", f"{path}: action {action!r:.40} is not one of {SPOT_ACTIONS}")
    try:
        deadline = parse_time(doc.get("time"), "time")
    except NoticeFormatError as exc:
        raise SourceError("malformed", f"{path}: {exc}") from None
    return [Notice(id=notice_id(source, node, instance, action, doc["time"]), kind=Kind.RECLAIM,
                   source=source, node=node, detected_at=now or now_utc(), deadline=deadline,
                   detail={"action": action, "time": doc["time"]})]


def parse_rebalance(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                    source: str = "aws.rebalance", now: datetime | None = None,
                    instance: str = FALLBACK) -> list[Notice]:
    """events/recommendations/rebalance -> one rebalance notice (no deadline), id from noticeTime."""
    resp, path = Response(status, headers, body), REBALANCE_PATH
    if resp.status == 404:
        return []
    expect_status(resp, path, 200)
    doc = json_body(resp, path)
    if not isinstance(doc, dict) or not isinstance(doc.get("noticeTime"), str):
        raise SourceError("malformed", f"{path}: expected {{\"noticeTime\": ...}}")
    try:
        parse_time(doc["noticeTime"], "noticeTime")
    except NoticeFormatError as exc:
        raise SourceError("malformed", f"{path}: {exc}") from None
    return [Notice(id=notice_id(source, node, instance, doc["noticeTime"]), kind=Kind.REBALANCE,
                   source=source, node=node, detected_at=now or now_utc(), deadline=None,
                   detail={"noticeTime": doc["noticeTime"]})]


def parse_maintenance(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                      source: str = "aws.maintenance", now: datetime | None = None,
                      instance: str = FALLBACK) -> list[Notice]:
    """events/maintenance/scheduled -> one maintenance notice per active event, deadline =
    NotBefore, id from EventId; completed and canceled events show nothing."""
    resp, path = Response(status, headers, body), MAINTENANCE_PATH
    if resp.status == 404:
        return []
    expect_status(resp, path, 200)
    doc = json_body(resp, path)
    if not isinstance(doc, list):
        raise SourceError("malformed", f"{path}: expected a JSON array")
    notices = []
    for i, event in enumerate(doc):
        if not isinstance(event, dict) or not isinstance(event.get("EventId"), str) or not event["EventId"]:
            raise SourceError("malformed", f"{path}[{i}]: expected an object with an EventId")
        state = event.get("State")
        if not isinstance(state, str) or state not in ("active", "completed", "canceled"):
            raise SourceError("malformed", f"{path}[{i}].State: {state!r:.40}")
        not_before = parse_maintenance_time(event.get("NotBefore"), f"{path}[{i}].NotBefore")
        if state != "active":
            continue
        detail = {k: event[k] for k in ("Code", "Description", "EventId", "NotBefore", "NotAfter", "State")
                  if isinstance(event.get(k), str)}
        notices.append(Notice(id=notice_id(source, node, instance, event["EventId"]), kind=Kind.MAINTENANCE,
                              source=source, node=node, detected_at=now or now_utc(),
                              deadline=not_before, detail=detail))
    return notices


def parse_lifecycle(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                    source: str = "aws.asg", now: datetime | None = None,
                    instance: str = FALLBACK) -> list[Notice]:
    """autoscaling/target-lifecycle-state -> a drain notice when the state ends in Terminated."""
    resp, path = Response(status, headers, body), LIFECYCLE_PATH
    if resp.status == 404:
        return []
    expect_status(resp, path, 200)
    state = resp.text().strip()
    if state not in LIFECYCLE_STATES:
        raise SourceError("malformed", f"{path}: unknown lifecycle state {state!r:.40}")
    if not state.endswith("Terminated"):
        return []
    return [Notice(id=notice_id(source, node, instance, state), kind=Kind.DRAIN, source=source,
                   node=node, detected_at=now or now_utc(), deadline=None,
                   detail={"target-lifecycle-state": state})]


class _ImdsSource(Source):
    """One IMDS path, read with `imds.get` and parsed by the pure function `parse`."""

    path: str = ""
    parse = staticmethod(parse_instance_action)

    def __init__(self, imds: ImdsClient, node: str, interval: float = 1.0, owns_client: bool = False,
                 identity: InstanceIdentity | None = None):
        super().__init__(node, interval)
        self.imds = imds
        self.instance = InstancePin(identity or imds.identity(), self.stats.errors)
        self._owns_client = owns_client

    async def poll(self) -> list[Notice]:
        self.instance.prefetch()
        resp = await self.imds.get(self.path)
        return await self.instance.identify(
            lambda instance: self.parse(resp.status, resp.headers, resp.body, node=self.node, source=self.name,
                                        instance=instance),
            has_live=bool(self._live))

    async def close(self) -> None:
        await self.instance.close()
        if self._owns_client:
            await self.imds.close()


class SpotInterruptionSource(_ImdsSource):
    name = "aws.spot"
    path = SPOT_PATH
    parse = staticmethod(parse_instance_action)


class RebalanceSource(_ImdsSource):
    name = "aws.rebalance"
    path = REBALANCE_PATH
    parse = staticmethod(parse_rebalance)


class MaintenanceSource(_ImdsSource):
    name = "aws.maintenance"
    path = MAINTENANCE_PATH
    interval_default = 5.0
    parse = staticmethod(parse_maintenance)


class LifecycleSource(_ImdsSource):
    name = "aws.asg"
    path = LIFECYCLE_PATH
    parse = staticmethod(parse_lifecycle)


def aws_sources(node: str, base_url: str = DEFAULT_URL, interval: float = 1.0,
                maintenance_interval: float = 5.0, timeout: float = 2.0) -> list[Source]:
    """The AWS monitors for one node, sharing one IMDS client (the first one closes it) and the
    instance-id it reads once."""
    imds = ImdsClient(base_url, timeout=timeout)
    identity = imds.identity()
    return [
        SpotInterruptionSource(imds, node, interval, owns_client=True, identity=identity),
        RebalanceSource(imds, node, interval, identity=identity),
        MaintenanceSource(imds, node, maintenance_interval, identity=identity),
        LifecycleSource(imds, node, interval, identity=identity),
    ]
