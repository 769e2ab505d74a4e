"""Runs a notice source in the background during a test and checks what it yielded.

`SourceRunner` pumps `source.run()` into a list; `wait_for` waits for an update matching a
predicate, `wait_until` for any condition (stats, emulator state). Leaving the context cancels
the loop and closes the source, with a timeout. `fault_then_detect` is the fault sweep every
cloud's tests share.
"""
from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Callable

from spotguard.agent.sources.base import Source
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Update, Withdrawal

# fault kind -> (extra fault fields, error reasons the source may count for it)
FAULTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "latency": ({"seconds": 3.0}, ("timeout",)),
    "hang": ({"seconds": 30.0}, ("timeout",)),
    "status-5xx": ({"kind": "status", "status": 503}, ("http_5xx",)),
    "status-429": ({"kind": "status", "status": 429}, ("http_429",)),
    "malformed": ({}, ("malformed",)),
    "oversized": ({"bytes": 256 * 1024}, ("oversized",)),
    # aiohttp retries an idempotent request once when a reused connection drops: drop two
    "drop": ({"count": 2}, ("connect", "malformed")),
}


class SourceRunner:
    """`async with SourceRunner(source) as run:` runs the source until the block ends."""

    def __init__(self, source: Source):
        self.source = source
        self.updates: list[Update] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> SourceRunner:
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=5)
        if not self._task.done():
            raise AssertionError(f"{self.source.name}: run() did not stop within 5 s of cancellation")
        if not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()

    async def _pump(self) -> None:
        async for update in self.source.run():
            self.updates.append(update)
            self._changed.set()

    @property
    def notices(self) -> list[Notice]:
        return [u for u in self.updates if isinstance(u, Notice)]

    @property
    def withdrawals(self) -> list[Withdrawal]:
        return [u for u in self.updates if isinstance(u, Withdrawal)]

    async def wait_for(self, predicate: Callable[[Update], bool], timeout: float = 8.0, start: int = 0) -> Update:
        """The first update at index >= start matching predicate; AssertionError after timeout."""
        async def scan() -> Update:
            while True:
                for update in self.updates[start:]:
                    if predicate(update):
                        return update
                self._changed.clear()
                await self._changed.wait()
        try:
            return await asyncio.wait_for(scan(), timeout)
        except TimeoutError:
            raise AssertionError(f"{self.source.name}: no matching update within {timeout}s; "
                                 f"got {self.updates!r}; stats {self.source.stats!r}") from None

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 8.0, what: str = "condition") -> None:
        """Polls `condition` every 10 ms; AssertionError after timeout."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not condition():
            if loop.time() > end:
                raise AssertionError(f"{self.source.name}: {what} not met within {timeout}s; "
                                     f"stats {self.source.stats!r}; updates {self.updates!r}")
            await asyncio.sleep(0.01)


async def fault_then_detect(runner: SourceRunner, control, fault: str, path: str,
                            schedule: Callable[[], Any], is_expected: Callable[[Notice], bool]) -> Notice:
    """Injects `fault` (a key of FAULTS) on `path` once the source has read cleanly, checks the
    source counts the matching error and yields nothing, then that a valid notice scheduled
    afterwards (by `schedule()`) is still detected. Returns that notice."""
    fields, reasons = FAULTS[fault]
    source = runner.source
    await runner.wait_until(lambda: source.stats.successes >= 1, what="a first clean read")
    spec = {"kind": fault, "path": path, "count": 1, **fields}
    await control.fault(**spec)
    await runner.wait_until(lambda: any(source.stats.errors[r] for r in reasons), timeout=10,
                            what=f"an error counted as {reasons}")
    assert runner.updates == [], f"a {fault} fault yielded {runner.updates!r}"
    await control.clear_faults()
    await schedule()
    notice = await runner.wait_for(lambda u: isinstance(u, Notice), timeout=10)
    assert is_expected(notice), notice
    assert runner.withdrawals == []
    return notice
