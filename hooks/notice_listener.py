"""The Guard's background thread: the sidecar's notice stream, read with the standard library.

Contract:
- `NoticeListener(url, on_notice, on_withdrawn)` connects to `<url>/v1/stream` (SSE) with
  `http.client` (no asyncio in a training process), decodes with `wire.sse.SSEDecoder`, keeps
  the live notices in a `wire.live.LiveSet` (the set the sidecar's relay keeps too) and calls
  `on_notice(notice)` for every notice that is new, or whose content changed (dedupe by id).
  `on_withdrawn(notice_id)` gets withdrawals (every `withdrawn` event, held or not). Both run on
  this thread and must be quick.
- A `snapshot` event is applied by the rule every consumer shares (`wire.snapshot.reconcile`,
  through the LiveSet): its new or changed notices are delivered the same way, and a notice
  delivered earlier that it lacks is withdrawn (`on_withdrawn`) only when the snapshot is
  complete; a snapshot with any bad part is refused whole. A `membership` event's JSON object goes
  to `on_membership` (the in-place Guard and a joiner use it; skipped quietly without one).
- Malformed input (bad JSON, a bad notice, an unknown event type) is logged with what was wrong
  and skipped: nothing changes. A broken byte stream (not UTF-8, an endless line) drops the
  connection and reconnects with a fresh decoder.
- Connection failures reconnect with `spotguard.backoff.Backoff`; the sidecar sends a keepalive
  every 10 s, so a read silent for `read_timeout` s counts as a failure. Nothing ever raises
  into training; `stop()` ends the thread (daemon, so it never holds the process either).
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from typing import Any
from collections.abc import Callable

from spotguard.backoff import Backoff
from spotguard.wire.live import Change, LiveSet
from spotguard.wire.notice import Notice, NoticeFormatError
from spotguard.wire.snapshot import parse_snapshot
from spotguard.wire.sse import SSEDecoder, SSEError, SSEEvent
from spotguard.wire.withdrawal import parse_withdrawal

log = logging.getLogger("spotguard.hooks.listener")

STREAM_PATH = "/v1/stream"


class NoticeListener(threading.Thread):
    """Reads the sidecar's stream on a daemon thread and forwards new notices."""

    def __init__(self, url: str, on_notice: Callable[[Notice], None], on_withdrawn: Callable[[str], None] | None = None,
                 *, read_timeout: float = 30.0, backoff: Backoff | None = None,
                 on_membership: Callable[[dict], None] | None = None):
        super().__init__(name="spotguard-notice-listener", daemon=True)
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self._parsed = parsed
        self._host: str = parsed.hostname  # checked non-empty above
        self._on_notice = on_notice
        self._on_withdrawn = on_withdrawn or (lambda _id: None)
        self._on_membership = on_membership
        self.read_timeout = read_timeout
        self._backoff = backoff or Backoff(base=0.1, cap=5.0)
        self._stop_event = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._live = LiveSet()
        self.connected = threading.Event()
        self.last_notice_at: float | None = None  # time.time() when the newest notice was forwarded
        self.stats = {"connects": 0, "notices": 0, "malformed": 0, "errors": 0}

    # ---- thread ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._read_stream()
            except Exception as exc:
                if self._stop_event.is_set():
                    break
                self.stats["errors"] += 1
                log.warning("sidecar stream %s%s: %s; reconnecting", self.url, STREAM_PATH, exc or type(exc).__name__)
            finally:
                self.connected.clear()
                self._close()
            if self._stop_event.wait(self._backoff.next_delay()):
                break

    def stop(self, timeout: float = 2.0) -> None:
        """Ends the thread: wakes a blocked read by shutting the socket down."""
        self._stop_event.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _read_stream(self) -> None:
        cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._host, self._parsed.port, timeout=self.read_timeout)
        self._conn = conn
        base = self._parsed.path.rstrip("/")
        conn.request("GET", base + STREAM_PATH, headers={"Accept": "text/event-stream", "Cache-Control": "no-cache"})
        response = conn.getresponse()
        if response.status != 200:
            raise ConnectionError(f"HTTP {response.status} {response.reason}")
        self.stats["connects"] += 1
        self._backoff.reset()
        self.connected.set()
        decoder = SSEDecoder()
        while not self._stop_event.is_set():
            chunk = response.read1(65536)
            if not chunk:
                raise ConnectionError("stream ended")
            try:
                events = decoder.feed(chunk)
            except SSEError as exc:
                self.stats["malformed"] += 1
                raise ConnectionError(f"malformed stream ({exc})") from None
            for event in events:
                self.handle(event)

    # ---- events ---------------------------------------------------------------------------
    def handle(self, event: SSEEvent) -> None:
        """Applies one event; malformed ones are logged and change nothing."""
        try:
            if event.event == "notice":
                self._deliver(self._live.upsert(Notice.from_wire(self._json(event))))
            elif event.event == "snapshot":
                self._deliver(self._live.apply_snapshot(parse_snapshot(self._json(event))))
            elif event.event == "withdrawn":
                withdrawal = parse_withdrawal(self._json(event))
                self._live.withdraw(withdrawal)
                self._withdraw(withdrawal.notice_id, withdrawal.reason)
            elif event.event == "membership":
                data = self._json(event)
                if not isinstance(data, dict):
                    raise NoticeFormatError("membership: expected a JSON object")
                if self._on_membership is not None:
                    self._on_membership(data)
            else:
                raise NoticeFormatError(f"unknown event type {event.event!r:.40}")
        except (NoticeFormatError, ValueError) as exc:
            self._malformed(event, exc)

    @staticmethod
    def _json(event: SSEEvent) -> Any:
        try:
            return json.loads(event.data)
        except ValueError as exc:
            raise NoticeFormatError(f"{event.event}: data is not JSON ({exc})") from None

    def _malformed(self, event: SSEEvent, exc: Exception) -> None:
        self.stats["malformed"] += 1
        log.warning("ignored malformed %r event id=%s from the sidecar: %s", event.event, event.id, exc)

    def _deliver(self, changes: list[Change]) -> None:
        for change in changes:
            if change.withdrawal is not None:
                self._withdraw(change.withdrawal.notice_id, change.withdrawal.reason)
            elif change.notice is not None:
                self.stats["notices"] += 1
                self.last_notice_at = time.time()
                self._on_notice(change.notice)

    def _withdraw(self, notice_id: str, reason: str) -> None:
        log.info("notice %s withdrawn (%s)", notice_id, reason)
        self._on_withdrawn(notice_id)
