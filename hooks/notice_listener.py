"""The Guard's background thread: the sidecar's notice stream, read with the standard library.

Contract:
- `NoticeListener(url, on_notice, on_withdrawn)` connects to `<url>/v1/stream` (SSE) with
  `http.client` (no asyncio in a training process), decodes with `agent.sse.SSEDecoder` and calls
  `on_notice(notice)` for every notice that is new, or whose content changed (dedupe by id).
  `on_withdrawn(notice_id)` gets withdrawals. Both run on this thread and must be quick.
- A `snapshot` event is applied by the rule every consumer shares (`agent.snapshot.reconcile`):
  its new or changed notices are delivered the same way, and a notice delivered earlier that
  it lacks is withdrawn (`on_withdrawn`) only when the snapshot is complete; a snapshot with
  any bad part is refused whole. `membership` events are not the Guard's business (the
  sidecar rewrites the hostfile) and are skipped quietly.
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
from typing import Any, Callable

from spotguard.agent.notice import WIRE_VERSION, Notice, NoticeFormatError
from spotguard.agent.snapshot import parse_snapshot, reconcile
from spotguard.agent.sse import SSEDecoder, SSEError, SSEEvent
from spotguard.backoff import Backoff

log = logging.getLogger("spotguard.hooks.listener")

STREAM_PATH = "/v1/stream"


class NoticeListener(threading.Thread):
    """Reads the sidecar's stream on a daemon thread and forwards new notices."""

    def __init__(self, url: str, on_notice: Callable[[Notice], None], on_withdrawn: Callable[[str], None] | None = None,
                 *, read_timeout: float = 30.0, backoff: Backoff | None = None):
        super().__init__(name="spotguard-notice-listener", daemon=True)
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url.rstrip("/")
        self._parsed = parsed
        self._on_notice = on_notice
        self._on_withdrawn = on_withdrawn or (lambda _id: None)
        self.read_timeout = read_timeout
        self._backoff = backoff or Backoff(base=0.1, cap=5.0)
        self._stop_event = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._seen: dict[str, Notice] = {}
        self.connected = threading.Event()
        self.last_notice_at: float | None = None  # time.time() when the newest notice was forwarded
        self.stats = {"connects": 0, "notices": 0, "malformed": 0, "errors": 0}

    # ---- thread ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._read_stream()
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
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
        conn = cls(self._parsed.hostname, self._parsed.port, timeout=self.read_timeout)
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
                self._accept(Notice.from_wire(self._json(event)))
            elif event.event == "snapshot":
                diff = reconcile(self._seen, parse_snapshot(self._json(event)))
                for notice_id in diff.withdrawn:
                    self._withdraw(notice_id, "absent from a complete snapshot")
                for notice in diff.upserts:
                    self._accept(notice)
            elif event.event == "withdrawn":
                body = self._json(event)
                if not isinstance(body, dict) or body.get("v") != WIRE_VERSION or not isinstance(body.get("withdrawn"), str) or not body["withdrawn"]:
                    raise NoticeFormatError("withdrawn: expected {\"v\": 1, \"withdrawn\": \"<id>\", ...}")
                self._withdraw(body["withdrawn"], body.get("reason", "no reason given"))
            elif event.event == "membership":
                log.debug("membership event ignored by the Guard (the sidecar handles it)")
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

    def _withdraw(self, notice_id: str, reason: Any) -> None:
        log.info("notice %s withdrawn (%s)", notice_id, reason)
        self._seen.pop(notice_id, None)
        self._on_withdrawn(notice_id)

    def _accept(self, notice: Notice) -> None:
        known = self._seen.get(notice.id)
        if known is not None and known.same_event(notice):
            return
        self._seen[notice.id] = notice
        self.stats["notices"] += 1
        self.last_notice_at = time.time()
        self._on_notice(notice)
