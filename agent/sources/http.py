"""A small HTTP client for metadata services: timeouts, bounded bodies, errors as SourceError.

Every cloud source talks through `MetadataClient`, so the rules live in one place: each request
has a total timeout, a body larger than `max_body` is refused rather than buffered, and any
transport failure becomes a `SourceError` with a metrics label.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, UTC
from email.utils import parsedate_to_datetime
from collections.abc import Mapping

import aiohttp

from spotguard.agent.sources.base import SourceError

DEFAULT_MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def text(self) -> str:
        """The body as UTF-8; SourceError("malformed") when it is not."""
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError("malformed", "body is not UTF-8") from None


class MetadataClient:
    """HTTP to one metadata base URL. Not thread-safe; one per event loop."""

    def __init__(self, base_url: str, timeout: float = 2.0, max_body: int = DEFAULT_MAX_BODY):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_body = max_body
        self._session: aiohttp.ClientSession | None = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No proxies from the environment: metadata services must be reached directly.
            self._session = aiohttp.ClientSession(trust_env=False, auto_decompress=True,
                                                  connector=aiohttp.TCPConnector(limit=8))
        return self._session

    async def request(self, method: str, path: str, *, headers: Mapping[str, str] | None = None,
                      params: Mapping[str, str] | None = None, json_body: object = None,
                      timeout: float | None = None) -> Response:
        """Sends one request; returns the response whatever its status, or raises SourceError."""
        session = self._ensure_session()
        total = self.timeout if timeout is None else timeout
        try:
            async with session.request(method, self.base_url + path, headers=headers, params=params,
                                       json=json_body, allow_redirects=False,
                                       timeout=aiohttp.ClientTimeout(total=total)) as resp:
                declared = resp.content_length
                if declared is not None and declared > self.max_body:
                    raise SourceError("oversized", f"{path}: body of {declared} bytes exceeds {self.max_body}")
                body = await self._read_bounded(resp, path)
                return Response(resp.status, dict(resp.headers), body)
        except TimeoutError:
            raise SourceError("timeout", f"{method} {path}: no answer within {total:.1f}s") from None
        except aiohttp.ClientPayloadError as exc:
            raise SourceError("malformed", f"{method} {path}: broken body ({exc})") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SourceError("connect", f"{method} {path}: {exc.__class__.__name__}: {exc}") from None

    async def _read_bounded(self, resp: aiohttp.ClientResponse, path: str) -> bytes:
        """The whole body, read chunk by chunk (one `read(n)` may return less than is coming),
        refused with SourceError("oversized") as soon as it passes `max_body`."""
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await resp.content.read(self.max_body + 1 - size)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body:
                raise SourceError("oversized", f"{path}: body exceeds {self.max_body} bytes")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of header `name`, matched case-insensitively (None when absent)."""
    wanted = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == wanted:
            return value
    return None


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds a `Retry-After` value asks for (delta-seconds or an HTTP date); None when absent
    or unreadable. Never negative."""
    if not isinstance(value, str) or not value.strip() or len(value) > 64:
        return None
    text = value.strip()
    if text.isdigit():
        return float(min(int(text), 1 << 31))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def parse_text_leaf(status: int, headers: Mapping[str, str], body: bytes, *, path: str, pattern: re.Pattern[str],
                    what: str) -> str:
    """The value a metadata leaf answered as text (`what` and `path` name it in errors):
    SourceError unless it is a 200 whose stripped UTF-8 body matches `pattern` in full."""
    resp = Response(status, headers, body)
    expect_status(resp, path, 200)
    value = resp.text().strip()
    if not pattern.fullmatch(value):
        raise SourceError("malformed", f"{path}: not {what}: {value!r:.60}")
    return value


def expect_status(resp: Response, path: str, *ok: int) -> None:
    """Raises SourceError labelled by status class unless resp.status is one of `ok`; a 429
    carries the seconds of its Retry-After, if any."""
    if resp.status in ok:
        return
    if resp.status == 429:
        raise SourceError("http_429", f"{path}: throttled",
                          retry_after=retry_after_seconds(header(resp.headers, "Retry-After")))
    if resp.status >= 500:
        raise SourceError("http_5xx", f"{path}: server error {resp.status}")
    raise SourceError(f"http_{resp.status}", f"{path}: unexpected status {resp.status}")
