"""The session-token handshake AWS IMDSv2 and Alibaba's hardened mode share, as the clouds do it.

`PUT token_path` with a TTL header (1..21600 s) issues a token (403 when `X-Forwarded-For` is
set, 400 for a missing or bad TTL); GETs then carry it in the token header. `guard(handler)`
answers 401 for an unknown or expired token, and for no token at all unless tokenless reads are
allowed (IMDSv1, or Alibaba without hardened mode). `expire()` invalidates every issued token.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.Response]]


class SessionTokens:
    def __init__(self, ttl_header: str, token_header: str, allow_tokenless: bool):
        self.ttl_header = ttl_header
        self.token_header = token_header
        self.allow_tokenless = allow_tokenless
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.issued = 0

    async def issue(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return web.Response(status=403, text="Forbidden")
        try:
            ttl = int(request.headers.get(self.ttl_header, ""))
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= 21600:
            return web.Response(status=400, text="Bad Request")
        token = secrets.token_urlsafe(32)
        self.tokens[token] = time.monotonic() + ttl
        self.issued += 1
        return web.Response(text=token, content_type="text/plain", headers={self.ttl_header: str(ttl)})

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.Response:
            token = request.headers.get(self.token_header)
            if token is None:
                if not self.allow_tokenless:
                    return web.Response(status=401, text="Unauthorized")
            else:
                expiry = self.tokens.get(token)
                if expiry is None or expiry < time.monotonic():
                    self.tokens.pop(token, None)
                    return web.Response(status=401, text="Unauthorized")
            return await handler(request)
        return guarded

    def expire(self) -> None:
        self.tokens.clear()
