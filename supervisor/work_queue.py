"""The controller's work queue: job keys in, one reconcile at a time per key, out.

Contract (all on the event loop):
- `add(key)` queues a key once (a key already queued is not queued twice; a key being worked
  on is marked dirty and queued again when its pass ends, so no change is lost);
- `add(key, delay)` queues it after `delay` seconds; of several delayed adds the earliest wins;
- `open()` starts accepting keys; `start(workers)` (opening if needed) runs `workers` tasks that
  call `handle(key)`, in the order keys were queued; a pass that raises is counted
  (`on_error`) and retried after a per-key exponential backoff (0.5 s doubling to 30 s, reset by
  a pass that succeeds);
- after `stop()` adds are ignored and no timer fires.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Generic, TypeVar
from collections.abc import Awaitable, Callable, Hashable

from spotguard.backoff import Backoff
from spotguard.kube.api import ApiError

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """See the module docstring."""

    def __init__(self, handle: Callable[[K], Awaitable[object]], on_error: Callable[[], None] = lambda: None):
        self.handle = handle
        self.on_error = on_error
        self._queue: asyncio.Queue[K] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: set[K] = set()
        self._busy: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._failures: dict[K, Backoff] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    @property
    def running(self) -> bool:
        return self._queue is not None and not self._stopped

    def open(self) -> None:
        if self._queue is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()

    def _opened(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Queue[K]]:
        """The loop and queue `open()` made; a RuntimeError when used before it."""
        if self._loop is None or self._queue is None:
            raise RuntimeError("WorkQueue used before open() or start()")
        return self._loop, self._queue

    def start(self, workers: int, name: str = "worker") -> None:
        self.open()
        self._tasks = [asyncio.create_task(self._work(), name=f"{name}-{i}") for i in range(max(1, workers))]

    async def stop(self) -> None:
        self._stopped = True
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def add(self, key: K, delay: float = 0.0) -> None:
        if not self.running:
            return
        loop, queue = self._opened()
        if delay > 0:
            when = loop.time() + delay
            timer = self._timers.get(key)
            if timer is not None and not timer.cancelled() and timer.when() <= when:
                return
            if timer is not None:
                timer.cancel()
            self._timers[key] = loop.call_at(when, self._fire, key)
            return
        if key in self._busy:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            queue.put_nowait(key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def _work(self) -> None:
        _, queue = self._opened()
        while True:
            key = await queue.get()
            self._queued.discard(key)
            self._busy.add(key)
            try:
                await self.handle(key)
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.on_error()
                delay = self._failures.setdefault(key, Backoff(base=0.5, cap=30.0)).next_delay()
                log.warning("reconcile %s failed (%s); retrying in %.1fs", "/".join(map(str, key)) if isinstance(
                    key, tuple) else key, exc, delay, exc_info=not isinstance(exc, ApiError))
                self.add(key, delay)
            finally:
                self._busy.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
