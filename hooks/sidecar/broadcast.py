"""Fan-out of stream events to the sidecar's subscribers, and a change pulse for waiters.

`Broadcaster.publish(event, data)` numbers the event and puts it on every subscriber's bounded
queue. A subscriber that falls `max_queue` events behind is cut off (its queue gets the
`CUT_OFF` marker): it reconnects and gets a fresh snapshot, so it loses nothing, and a slow
reader never makes the sidecar buffer without limit.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    seq: int
    event: str
    data: Any


CUT_OFF = Event(-1, "cut-off", None)
CLOSED = Event(-2, "closed", None)


class Broadcaster:
    """Numbered events to any number of subscriber queues (one event loop)."""

    def __init__(self, max_queue: int = 256):
        self.max_queue = max_queue
        self._seq = itertools.count(1)
        self._subscribers: set[asyncio.Queue] = set()

    def next_seq(self) -> int:
        return next(self._seq)

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.max_queue + 1)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def publish(self, event: str, data: Any) -> None:
        item = Event(self.next_seq(), event, data)
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_queue:
                self._subscribers.discard(queue)
                queue.put_nowait(CUT_OFF)
            else:
                queue.put_nowait(item)

    def close(self) -> None:
        """Ends every subscription (at shutdown)."""
        for queue in list(self._subscribers):
            self._subscribers.discard(queue)
            while queue.full():
                queue.get_nowait()
            queue.put_nowait(CLOSED)


class Pulse:
    """Wakes every coroutine waiting in `wait` whenever `notify` is called."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        """True if notified within `timeout` seconds."""
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except TimeoutError:
            return False
