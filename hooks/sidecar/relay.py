"""The sidecar's subscription to its node agent's stream, and the live notice set it keeps.

It keeps a `wire.live.LiveSet` (the live set every stream consumer shares): the agent's
snapshots, notices and withdrawals are applied to it and only the changes go downstream; the
first complete snapshot yields a `Change(resync=True)`, telling the sidecar to send its
subscribers a fresh, complete snapshot.

`Relay.run()` keeps one GET /v1/stream open to the agent, reconnecting with backoff (reset
after each good snapshot) and treating a silent connection (no bytes, not even the agent's
10 s keepalive, for `idle_timeout` s) as dead. Malformed input never stops it: a bad event is
logged and ignored (a bad snapshot changes nothing); broken SSE framing drops the connection
and reconnects. Changes go to `on_change(changes)`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from spotguard.backoff import Backoff
from spotguard.wire.live import Change, LiveSet
from spotguard.wire.notice import Notice
from spotguard.wire.snapshot import parse_snapshot
from spotguard.wire.sse import SSEDecoder, SSEError
from spotguard.wire.withdrawal import parse_withdrawal

log = logging.getLogger(__name__)


class Relay:
    """Follows `<agent_url>/v1/stream` into `live`; reports changes to `on_change`."""

    def __init__(self, agent_url: str, on_change: Callable[[list[Change]], Awaitable[None]],
                 live: LiveSet | None = None, idle_timeout: float = 35.0, connect_timeout: float = 5.0,
                 backoff: Backoff | None = None, max_event_bytes: int = 1 << 20):
        self.stream_url = agent_url.rstrip("/") + "/v1/stream"
        self.on_change = on_change
        self.live = live if live is not None else LiveSet()
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff(base=0.2, cap=5.0)
        self.max_event_bytes = max_event_bytes
        self.connected = False
        self.connections = 0  # successful connections so far
        self.snapshots = 0  # good snapshots applied so far
        self.rejected = 0  # malformed events ignored so far

    async def run(self) -> None:
        """Runs until cancelled; never raises for anything the agent or network does."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.idle_timeout)
        async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
            while True:
                try:
                    await self._follow(session)
                except asyncio.CancelledError:
                    raise
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    log.warning("agent stream %s: %s: %s", self.stream_url, type(exc).__name__, exc)
                except SSEError as exc:
                    log.error("agent stream %s: broken framing (%s); reconnecting", self.stream_url, exc)
                except Exception:
                    log.exception("agent stream %s: unexpected failure; reconnecting", self.stream_url)
                finally:
                    self.connected = False
                await asyncio.sleep(self.backoff.next_delay())

    async def _follow(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self.stream_url, headers={"Accept": "text/event-stream"}) as resp:
            if resp.status != 200:
                log.warning("agent stream %s: HTTP %s", self.stream_url, resp.status)
                return
            self.connected = True
            self.connections += 1
            log.info("agent stream connected: %s", self.stream_url)
            decoder = SSEDecoder(max_line=self.max_event_bytes)
            async for chunk in resp.content.iter_any():
                for event in decoder.feed(chunk):
                    await self.handle(event.event, event.data)
            log.warning("agent stream %s: closed by the agent", self.stream_url)

    async def handle(self, event: str, data: str) -> list[Change]:
        """Applies one stream event; a malformed one is logged and changes nothing."""
        try:
            obj = json.loads(data)
            if event == "snapshot":
                changes = self.live.apply_snapshot(parse_snapshot(obj))
                self.snapshots += 1
                self.backoff.reset()
            elif event == "notice":
                changes = self.live.upsert(Notice.from_wire(obj))
            elif event == "withdrawn":
                changes = self.live.withdraw(parse_withdrawal(obj))
            else:
                log.info("agent stream: ignoring unknown event type %r", event[:40])
                return []
        except (ValueError, TypeError) as exc:  # NoticeFormatError, JSONDecodeError are ValueErrors
            self.rejected += 1
            log.error("agent stream: ignoring malformed %r event: %s", event[:40], exc)
            return []
        if changes:
            await self.on_change(changes)
        return changes
