"""How the local cluster's controllers run: level-triggered passes, woken by any write to the
local API (`LocalKube.subscribe`) or by the time a pass asked to be looked at again.

`Wakeup` is one `asyncio.Event` per controller, set from any thread. `keep_reconciling(sync,
wakeup, idle)` calls `sync()` (one pass over everything; it returns the seconds until it wants
another pass, or None) whenever woken, at the latest after `idle` seconds, until cancelled. A
pass that raises is logged and the next one runs after `idle`: one bad object never stops the
cluster.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Wakeup:
    """An event the local API's writes set (from whatever thread wrote)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def __call__(self, *_written: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nothing is waiting any more
            pass


async def keep_reconciling(sync: Callable[[], float | None], wakeup: Wakeup, idle: float = 1.0,
                           name: str = "controller") -> None:
    """See the module docstring."""
    while True:
        wakeup.event.clear()
        try:
            again = sync()
        except Exception:
            log.exception("%s: a pass failed; trying again in %.1fs", name, idle)
            again = idle
        delay = idle if again is None else max(0.0, min(idle, again))
        # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the event is set, and the loop would then never end.
        waiter = asyncio.ensure_future(wakeup.event.wait())
        try:
            await asyncio.wait({waiter}, timeout=delay)
        finally:
            waiter.cancel()
