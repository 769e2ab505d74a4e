"""Runs a source's `run()` loop in a task during a test and collects what it yields."""
from __future__ import annotations

import asyncio
import time


class RunningSource:
    """Runs `source.run()` in a task, collecting updates; stopped (and checked alive) by the test."""

    def __init__(self, source):
        self.source = source
        self.updates: list = []
        self._arrived = asyncio.Event()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for update in self.source.run():
            self.updates.append(update)
            self._arrived.set()

    async def wait_for(self, predicate, timeout: float = 5.0, after: int = 0):
        """The first update (from index `after` on) matching `predicate`; fails after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            for update in self.updates[after:]:
                if predicate(update):
                    return update
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching update within {timeout}s: {self.updates!r}")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                pass

    async def wait_errors(self, reason: str, n: int = 1, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.source.stats.errors[reason] < n:
            assert not self.task.done(), "run() ended"
            if time.monotonic() > deadline:
                raise AssertionError(f"{reason} not counted {n}x: {self.source.stats.errors!r}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        assert not self.task.done(), "run() must never end on its own"
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
