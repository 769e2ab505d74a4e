"""The live notice table: one deduplicated view of every notice the node's sources report.

Contract:
- Updates come in as `apply(origin, update)`, where `origin` names the reporting source
  instance (two instances of the same source class are two origins).
- Notices are keyed by id. Several origins may report the same id; the published notice is
  the one with the earliest deadline (None sorts last). Its `detected_at` is the first time
  the table saw the id, kept for as long as the id stays live.
- A changed notice (moved deadline, new detail) is published again as a `Notice` change; a
  report identical to what is published changes nothing.
- A `Withdrawal` removes only that origin's report; the id is withdrawn (published as a
  `Withdrawal`) when no origin reports it any more.
- Every published change gets the next sequence number (1, 2, ...). Subscribers get a
  snapshot and the sequence number it reflects atomically with their registration, then
  every later change in order; a subscriber that falls `max_backlog` changes behind is closed
  (it reconnects and gets a fresh snapshot, so it loses nothing).
- Listeners (`add_listener`) are plain callables called synchronously after every change; an
  exception in one is logged and never stops the table.
- `complete` says whether the table is authoritative (its owner calls `mark_complete()` once
  every source has read at least once). Subscriptions carry it with their snapshot; on
  `mark_complete()` every subscriber gets a `Resync` (the live set at the current sequence
  number, now complete) in order with the changes, so a consumer that was given an
  incomplete snapshot learns what is really gone.

The table is single-threaded: use it from one event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable, Iterable
from datetime import datetime

from spotguard.wire.notice import Notice
from spotguard.wire.urgency import deadline_key, most_urgent_first
from spotguard.wire.withdrawal import Update, Withdrawal

log = logging.getLogger(__name__)

Change = Notice | Withdrawal
Listener = Callable[["Published"], None]
Sink = Callable[[object], "str | None"]


@dataclass(frozen=True)
class Published:
    """One change as the table published it: its sequence number and when (monotonic)."""

    seq: int
    change: Change
    published_monotonic: float
    origin: str


TICK = object()
"""What `Subscription.next()` returns after `NoticeTable.tick()`: time for a keepalive."""


@dataclass(frozen=True)
class Resync:
    """The whole live set at sequence number `seq`, sent to subscribers when the table became
    complete (the server sends it as a fresh snapshot)."""

    seq: int
    notices: list[Notice]


class Subscription:
    """A subscriber's view: `snapshot` (live notices at `seq`; `complete` when the table was
    authoritative then), then changes via `next()`.

    `next()` returns the next `Published` change, a `Resync`, `TICK` after a
    `NoticeTable.tick()`, or None once the subscription is closed (agent shutting down, or the
    subscriber fell too far behind: `overflowed` says which).
    """

    def __init__(self, table: NoticeTable, snapshot: list[Notice], seq: int, max_backlog: int,
                 complete: bool = True):
        self._table = table
        self.snapshot = snapshot
        self.seq = seq
        self.complete = complete
        self._queue: asyncio.Queue[Published | Resync | None] = asyncio.Queue()
        self._max_backlog = max_backlog
        self._sink: Sink | None = None
        self.closed = False
        self.overflowed = False

    def attach(self, sink: Sink) -> None:
        """Delivers every later change (and TICK) by calling `sink(item)` synchronously from the
        publisher, after first passing it what is queued: the fastest fan-out, no task wake-up
        per subscriber. `sink` returns None when delivered, "full" when the subscriber is too
        far behind, or any other string when it is gone; either closes the subscription.
        Afterwards `next()` only returns None, once closed."""
        while not self._queue.empty() and not self.closed:
            item = self._queue.get_nowait()
            if item is None:
                self._queue.put_nowait(None)
                return
            self._deliver(sink, item)
        if not self.closed:
            self._sink = sink

    def _deliver(self, sink: Sink, item: Published | object) -> None:
        try:
            problem = sink(item)
        except Exception:
            log.exception("stream sink failed")
            problem = "error"
        if problem is not None:
            self.overflowed = problem == "full"
            self._close()

    def _push(self, published: Published | Resync) -> None:
        if self.closed:
            return
        if self._sink is not None:
            self._deliver(self._sink, published)
            return
        if self._queue.qsize() >= self._max_backlog:
            self.overflowed = True
            self._close()
            return
        self._queue.put_nowait(published)

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sink = None
            self._queue.put_nowait(None)
            self._table._subscribers.discard(self)

    def _tick(self) -> None:
        if self._sink is not None and not self.closed:
            self._deliver(self._sink, TICK)
        elif not self.closed and self._queue.empty():
            self._queue.put_nowait(TICK)  # type: ignore[arg-type]

    async def next(self, timeout: float | None = None) -> Published | Resync | None:
        """The next change (or TICK); None when closed. TimeoutError after `timeout` seconds."""
        if timeout is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), timeout)

    def close(self) -> None:
        """Unsubscribes; idempotent."""
        self._close()


class NoticeTable:
    """See the module docstring."""

    def __init__(self, node: str, max_backlog: int = 1024):
        self.node = node
        self.max_backlog = max_backlog
        self.seq = 0
        self._reports: dict[str, dict[str, Notice]] = {}  # id -> origin -> last report
        self._published: dict[str, Notice] = {}  # id -> what subscribers see
        self._first_seen: dict[str, datetime] = {}
        self._subscribers: set[Subscription] = set()
        self._listeners: list[Listener] = []
        self.closed = False
        self.complete = False

    # -- reading -------------------------------------------------------------------------------

    def live(self) -> list[Notice]:
        """The live notices, most urgent first (`wire.urgency`)."""
        return most_urgent_first(self._published.values())

    def get(self, notice_id: str) -> Notice | None:
        return self._published.get(notice_id)

    def origins_of(self, notice_id: str) -> list[str]:
        """The origins currently reporting `notice_id` (empty when it is not live)."""
        return list(self._reports.get(notice_id, {}))

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    # -- subscribing ---------------------------------------------------------------------------

    def subscribe(self) -> Subscription:
        """Registers a subscriber; its snapshot and the changes after it never overlap or gap."""
        sub = Subscription(self, self.live(), self.seq, self.max_backlog, self.complete)
        if self.closed:
            sub._close()
        else:
            self._subscribers.add(sub)
        return sub

    def tick(self) -> None:
        """Wakes every idle subscriber with TICK (the server sends keepalives on it)."""
        for sub in list(self._subscribers):
            sub._tick()

    def mark_complete(self) -> None:
        """The table is authoritative from now on; every subscriber gets a `Resync`. Idempotent."""
        if self.complete or self.closed:
            return
        self.complete = True
        resync = Resync(self.seq, self.live())
        for sub in list(self._subscribers):
            sub._push(resync)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def close(self) -> None:
        """Ends every subscription (streams end cleanly); later updates are ignored."""
        self.closed = True
        for sub in list(self._subscribers):
            sub._close()

    # -- writing -------------------------------------------------------------------------------

    def apply(self, origin: str, update: Update) -> list[Published]:
        """Folds one source update into the table; returns the changes it published."""
        if self.closed:
            return []
        if isinstance(update, Notice):
            return self._report(origin, update)
        if isinstance(update, Withdrawal):
            return self._withdraw(origin, update)
        raise TypeError(f"not an update: {type(update).__name__}")

    def withdraw_origin(self, origin: str, reason: str = "source stopped") -> list[Published]:
        """Drops every report of `origin` (used when a source is removed for good)."""
        out: list[Published] = []
        for notice_id in [i for i, reports in self._reports.items() if origin in reports]:
            source = self._reports[notice_id][origin].source
            out += self._withdraw(origin, Withdrawal(notice_id, source, self.node, reason))
        return out

    def _report(self, origin: str, notice: Notice) -> list[Published]:
        reports = self._reports.setdefault(notice.id, {})
        reports[origin] = notice
        return self._republish(notice.id, origin, reason=None)

    def _withdraw(self, origin: str, withdrawal: Withdrawal) -> list[Published]:
        reports = self._reports.get(withdrawal.notice_id)
        if reports is None or origin not in reports:
            return []
        del reports[origin]
        return self._republish(withdrawal.notice_id, origin, reason=withdrawal.reason,
                               withdrawal=withdrawal)

    def _republish(self, notice_id: str, origin: str, reason: str | None,
                   withdrawal: Withdrawal | None = None) -> list[Published]:
        reports = self._reports.get(notice_id) or {}
        previous = self._published.get(notice_id)
        if not reports:
            self._reports.pop(notice_id, None)
            self._first_seen.pop(notice_id, None)
            if previous is None:
                return []
            del self._published[notice_id]
            gone = withdrawal or Withdrawal(notice_id, previous.source, self.node, reason or "withdrawn")
            if gone.source != previous.source or gone.node != previous.node:
                gone = Withdrawal(notice_id, previous.source, previous.node, gone.reason)
            return [self._publish(gone, origin)]
        winner = min(reports.values(), key=lambda n: (deadline_key(n), n.source))
        first_seen = self._first_seen.setdefault(notice_id, min(n.detected_at for n in reports.values()))
        winner = replace(winner, detected_at=first_seen)
        if previous is not None and previous.same_event(winner):
            return []
        self._published[notice_id] = winner
        return [self._publish(winner, origin)]

    def _publish(self, change: Change, origin: str) -> Published:
        self.seq += 1
        published = Published(self.seq, change, time.monotonic(), origin)
        for sub in list(self._subscribers):
            sub._push(published)
        for listener in self._listeners:
            try:
                listener(published)
            except Exception:  # a listener bug must not stop publishing
                log.exception("notice table listener failed")
        return published


def apply_all(table: NoticeTable, origin: str, updates: Iterable[Update]) -> list[Published]:
    """Applies several updates in order; returns every change published."""
    out: list[Published] = []
    for update in updates:
        out += table.apply(origin, update)
    return out

