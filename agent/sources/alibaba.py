"""Alibaba Cloud ECS notice source: the spot termination time.

`TerminationTimeSource` (alibaba.spot) polls /latest/meta-data/instance/spot/termination-time:
404 -> nothing; a UTC timestamp -> one reclaim notice with deadline = that time and an id
derived from it and the instance's `instance-id` (read once: `instance.py`), so the same reclaim
gives the same id on every read and after a restart, and a re-created instance a new one.

Requests go through `EcsMetadataClient`, which uses the hardened mode's session token when the
server gives one (PUT /latest/api/token) and plain GETs otherwise, so it works with hardened
mode on or off. A 401 drops the token and retries once with a fresh one.
"""
from __future__ import annotations

import logging
import re
from datetime import datetime
from collections.abc import Mapping

from spotguard.agent.sources.base import Source, SourceError
from spotguard.agent.sources.http import Response, expect_status
from spotguard.agent.sources.instance import FALLBACK, InstanceIdentity, InstancePin
from spotguard.agent.sources.session_token import SessionTokenClient
from spotguard.wire.notice import Kind, Notice, NoticeFormatError, format_time, notice_id, now_utc, parse_time

log = logging.getLogger(__name__)

DEFAULT_URL = "http://100.100.100.200"
TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aliyun-ecs-metadata-token"
TERMINATION_PATH = "/latest/meta-data/instance/spot/termination-time"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
_INSTANCE_ID = re.compile(r"i-[0-9a-z]{8,32}")


class EcsMetadataClient(SessionTokenClient):
    """ECS metadata with hardened-mode session tokens, reading without one when none is given."""

    token_path = TOKEN_PATH
    ttl_header = TTL_HEADER
    token_header = TOKEN_HEADER
    default_url = DEFAULT_URL
    label = "ECS metadata"
    instance_id_path = INSTANCE_ID_PATH
    instance_id_pattern = _INSTANCE_ID


def parse_termination_time(status: int, headers: Mapping[str, str], body: bytes, *, node: str,
                           source: str = "alibaba.spot", now: datetime | None = None,
                           instance: str = FALLBACK) -> list[Notice]:
    """404 -> no notice; 200 with a zoned ISO 8601 time -> one reclaim notice, deadline = that
    time, id from the instance and that time. Anything else raises SourceError."""
    resp = Response(status, headers, body)
    if resp.status == 404:
        return []
    expect_status(resp, TERMINATION_PATH, 200)
    text = resp.text().strip()
    try:
        deadline = parse_time(text, "termination-time")
    except NoticeFormatError as exc:
        raise SourceError("malformed", f"{TERMINATION_PATH}: {exc}") from None
    stamp = format_time(deadline)
    return [Notice(id=notice_id(source, node, instance, stamp), kind=Kind.RECLAIM, source=source, node=node,
                   detected_at=now or now_utc(), deadline=deadline, detail={"termination-time": text})]


class TerminationTimeSource(Source):
    name = "alibaba.spot"
    path = TERMINATION_PATH

    def __init__(self, client: EcsMetadataClient, node: str, interval: float = 1.0, owns_client: bool = False,
                 identity: InstanceIdentity | None = None):
        super().__init__(node, interval)
        self.client = client
        self.instance = InstancePin(identity or client.identity(), self.stats.errors)
        self._owns_client = owns_client

    async def poll(self) -> list[Notice]:
        self.instance.prefetch()
        resp = await self.client.get(self.path)
        return await self.instance.identify(
            lambda instance: parse_termination_time(resp.status, resp.headers, resp.body, node=self.node,
                                                    source=self.name, instance=instance),
            has_live=bool(self._live))

    async def close(self) -> None:
        await self.instance.close()
        if self._owns_client:
            await self.client.close()


def alibaba_sources(node: str, base_url: str = DEFAULT_URL, interval: float = 1.0, timeout: float = 2.0,
                    token_ttl: int = 21600) -> list[Source]:
    """The Alibaba monitors for one node (one, today), with their own metadata client."""
    client = EcsMetadataClient(base_url, timeout=timeout, token_ttl=token_ttl)
    return [TerminationTimeSource(client, node, interval, owns_client=True)]
