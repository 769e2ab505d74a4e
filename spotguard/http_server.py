"""How spotguard's HTTP servers (the node agent, the sidecar) meet clients they cannot trust.

- `start_server(app, host, port, limits)` binds an aiohttp app with `ServerLimits` applied: a
  connection must complete a request's headers within `header_timeout` seconds of connecting
  (or of its previous response), else it is closed (aiohttp's keep-alive timer, which also
  runs before the first request, is that deadline); a body left unread after the response is
  drained for at most that long too; request lines and header fields are bounded. A request the HTTP
  parser refuses (oversized or broken headers, bad request line) is answered 400 by aiohttp and
  logged here as one INFO line without a traceback: a client's mistake is not the server's error.
  Everything else aiohttp logs is left as it is.
- `read_json(request, max_bytes, timeout)` reads a request body for a handler: at most
  `max_bytes` (413), within `timeout` seconds (408), intact (400 for a broken chunked body),
  UTF-8 JSON nested at most `spotguard.safe_json.MAX_DEPTH` levels (400). It raises
  `BodyError(status, message)`; handlers answer with that status and message.
- `client_address(request)`: the peer's IP address (what per-client limits count by).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from spotguard import safe_json

log = logging.getLogger("spotguard.http")


@dataclass(frozen=True)
class ServerLimits:
    """What a server allows one connection. `header_timeout` also closes idle keep-alive
    connections; a request being handled (a stream, a long poll) is never cut by it."""

    header_timeout: float = 10.0
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64


class ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger, with errors caused by what a client sent (HTTP parse errors:
    aiohttp answers them 400) logged at INFO on one line instead of ERROR with a traceback."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = str(exc_info.message or type(exc_info).__name__).splitlines()[0][:200]
            self.info("refused a malformed request (%s): %s", type(exc_info).__name__, reason)
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)


async def start_server(app: web.Application, host: str, port: int, limits: ServerLimits,
                       shutdown_timeout: float = 2.0) -> tuple[web.AppRunner, str, int]:
    """Binds `app` on host:port; returns the runner (call `cleanup()` to stop) and the bound
    host and port. OSError when the address cannot be bound (the runner is then cleaned up)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=limits.header_timeout, lingering_time=limits.header_timeout,
                           logger=ClientErrorLog(logging.getLogger("aiohttp.server"), {}),
                           max_line_size=limits.max_line_size, max_field_size=limits.max_field_size,
                           max_headers=limits.max_headers)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound_host, bound_port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
    return runner, bound_host, bound_port


class BodyError(Exception):
    """A request body that cannot be accepted; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, bounded in size and time; BodyError (413, 408, 400) otherwise."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise BodyError(413, f"body larger than {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await request.content.read(max_bytes + 1 - size)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                size += len(chunk)
                if size > max_bytes:
                    raise BodyError(413, f"body larger than {max_bytes} bytes")
    except TimeoutError:
        raise BodyError(408, f"body not received within {timeout:g} s") from None
    except web.RequestPayloadError as exc:
        raise BodyError(400, f"body: broken ({str(exc)[:200]})") from None


async def read_json(request: web.Request, max_bytes: int, timeout: float) -> Any:
    """The body parsed as JSON (see the module docstring); BodyError otherwise."""
    raw = await read_body(request, max_bytes, timeout)
    try:
        return safe_json.loads(raw)
    except safe_json.JSONInputError as exc:
        raise BodyError(400, f"body: {exc}") from None


def client_address(request: web.Request) -> str:
    """The peer's IP address ("unknown" when the transport does not say)."""
    return request.remote or "unknown"
