"""Small helpers shared by tests (no fixtures here; see conftest.py)."""
from __future__ import annotations

import asyncio
from typing import Any

from spotguard.agent.sources.base import Source
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Update, Withdrawal


async def next_update(source_iter, timeout: float = 5.0) -> Update:
    """The next update from a running `source.run()` iterator, or fail after `timeout` s."""
    return await asyncio.wait_for(source_iter.__anext__(), timeout)


async def poll_until(source: Source, predicate, timeout: float = 5.0, pause: float = 0.02) -> Any:
    """Calls `source.poll()` until predicate(result) is true; returns the result."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = await source.poll()
        except Exception as exc:  # the predicate decides what counts
            result = exc
        if predicate(result):
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{source.name}: condition not met within {timeout}s; last result {result!r}")
        await asyncio.sleep(pause)


def notices(updates: list[Update]) -> list[Notice]:
    return [u for u in updates if isinstance(u, Notice)]


def withdrawals(updates: list[Update]) -> list[Withdrawal]:
    return [u for u in updates if isinstance(u, Withdrawal)]
