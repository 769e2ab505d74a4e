"""Metadata access with session tokens (AWS IMDSv2, Alibaba hardened mode) and a tokenless fallback.

A token is fetched with `PUT token_path` (TTL in `ttl_header`) and sent back in `token_header`.
It is renewed when less than a tenth of its TTL is left, and at once on a 401 (then the GET is
retried once; `token_refreshes` counts these). When no token can be had (PUT refused, failing,
or answering something that is not a token), GETs go out without one, and a token is tried again
after `retry_token_after` seconds. Sources sharing one client poll concurrently: one PUT serves
them all. `identity()` reads the instance's id (`instance_id_path`, with the token) for them.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time

from spotguard.agent.sources.base import SourceError
from spotguard.agent.sources.http import MetadataClient, Response
from spotguard.agent.sources.instance import InstanceIdentity, parse_instance_id

log = logging.getLogger(__name__)
MAX_TOKEN_BYTES = 1024


class SessionTokenClient:
    """Subclasses set `token_path`, `ttl_header`, `token_header`, `default_url`, `label` (for logs),
    and the instance id's path and form (`instance_id_path`, `instance_id_pattern`)."""

    token_path = "/latest/api/token"
    ttl_header = ""
    token_header = ""
    label = "metadata"
    default_url = ""
    instance_id_path = "/latest/meta-data/instance-id"
    instance_id_pattern = re.compile(r"[\x21-\x7e]{1,64}")

    def __init__(self, base_url: str | None = None, timeout: float = 2.0, token_ttl: int = 21600,
                 retry_token_after: float = 60.0):
        base_url = base_url or self.default_url
        if not 1 <= token_ttl <= 21600:
            raise ValueError("token_ttl must be within 1..21600 seconds")
        self.http = MetadataClient(base_url, timeout=timeout)
        self.token_ttl = token_ttl
        self.retry_token_after = retry_token_after
        self.token_refreshes = 0
        self.tokenless = False  # True while GETs go out without a token
        self._token: str | None = None
        self._token_expiry = 0.0
        self._tokenless_until = 0.0
        self._token_lock = asyncio.Lock()

    async def _fetch_token(self) -> str | None:
        try:
            resp = await self.http.request("PUT", self.token_path, headers={self.ttl_header: str(self.token_ttl)})
        except SourceError as exc:
            log.info("%s token unavailable (%s): reading without one", self.label, exc)
            return None
        token = resp.body.strip()
        if resp.status != 200 or not token or len(token) > MAX_TOKEN_BYTES or any(c < 0x21 or c > 0x7e for c in token):
            log.info("%s token refused (HTTP %s): reading without one", self.label, resp.status)
            return None
        self._token_expiry = time.monotonic() + self.token_ttl
        return token.decode("ascii")

    def _token_due(self) -> bool:
        return self._token is None or self._token_expiry - time.monotonic() < self.token_ttl / 10

    async def _token_header(self) -> dict[str, str]:
        if time.monotonic() < self._tokenless_until:
            return {}
        if self._token_due():
            async with self._token_lock:
                if time.monotonic() < self._tokenless_until:
                    return {}
                if self._token_due():
                    self._token = await self._fetch_token()
                    self.tokenless = self._token is None
                    if self._token is None:
                        self._tokenless_until = time.monotonic() + self.retry_token_after
                        return {}
        token = self._token
        return {} if token is None else {self.token_header: token}

    async def get(self, path: str) -> Response:
        """GETs a metadata path; on 401 fetches a fresh token and retries once."""
        resp = await self.http.request("GET", path, headers=await self._token_header())
        if resp.status == 401:
            self.token_refreshes += 1
            self._token = None
            self._tokenless_until = 0.0
            resp = await self.http.request("GET", path, headers=await self._token_header())
            if resp.status == 401:
                raise SourceError("auth", f"{path}: 401 even with a fresh token")
        return resp

    async def instance_id(self) -> str:
        """This instance's id; SourceError when unreadable (no answer, an error, not an id)."""
        resp = await self.get(self.instance_id_path)
        return parse_instance_id(resp.status, resp.headers, resp.body, path=self.instance_id_path,
                                 pattern=self.instance_id_pattern)

    def identity(self) -> InstanceIdentity:
        """The instance's id, read through this client, for the sources sharing it."""
        return InstanceIdentity(self.instance_id, f"{self.label} {self.instance_id_path}")

    async def close(self) -> None:
        await self.http.close()
