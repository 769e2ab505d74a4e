"""What the emulated cloud is showing: scheduled notices that flip on at a set time.

A notice is scheduled with a delay (`in`) and a lead time (`lead`): at `serve_at` the cloud
starts showing it, with the action due at `deadline = serve_at + lead`. The flip happens in
an event-loop timer that records the real moment (`served_at`, wall clock) and wakes every
hanging request, so benchmarks can measure detection latency against it.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EmulatedNotice:
    id: str
    kind: str
    serve_at: float  # wall-clock seconds when the flip is scheduled
    lead: float  # seconds from the flip to the action
    params: dict[str, Any] = field(default_factory=dict)
    served_at: float | None = None  # wall-clock moment the flip actually ran
    canceled_at: float | None = None

    @property
    def deadline(self) -> float:
        return (self.served_at if self.served_at is not None else self.serve_at) + self.lead

    @property
    def served(self) -> bool:
        return self.served_at is not None

    @property
    def live(self) -> bool:
        return self.served and self.canceled_at is None

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "serve_at": self.serve_at, "served_at": self.served_at,
                "deadline": self.deadline, "canceled_at": self.canceled_at, "params": self.params}


class EmulatorState:
    """The notices of one emulated VM. Use from the server's event loop only."""

    def __init__(self) -> None:
        self.notices: dict[str, EmulatedNotice] = {}
        self.version = 1  # bumps on every visible change: ETags, DocumentIncarnation
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def schedule(self, kind: str, delay: float, lead: float, params: dict[str, Any]) -> EmulatedNotice:
        notice = EmulatedNotice(id=f"n{next(self._ids)}", kind=kind, serve_at=time.time() + delay,
                                lead=lead, params=params)
        self.notices[notice.id] = notice
        loop = asyncio.get_running_loop()
        if delay <= 0:
            self._flip(notice.id)
        else:
            self._timers[notice.id] = loop.call_later(delay, self._flip, notice.id)
        return notice

    def cancel(self, notice_id: str) -> EmulatedNotice:
        """Withdraws a notice (KeyError if unknown). A not-yet-served one never appears."""
        notice = self.notices[notice_id]
        timer = self._timers.pop(notice_id, None)
        if timer is not None:
            timer.cancel()
        if notice.canceled_at is None:
            notice.canceled_at = time.time()
            self._bump()
        return notice

    def reset(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.notices.clear()
        self._bump()

    def visible(self, include_canceled: bool = False) -> list[EmulatedNotice]:
        """Served notices in scheduling order; canceled ones only when asked for."""
        return [n for n in self.notices.values() if n.served and (include_canceled or n.canceled_at is None)]

    async def wait_for_change(self, since_version: int, timeout: float) -> bool:
        """Waits until `version` differs from since_version; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != since_version), timeout)
            except TimeoutError:
                return False
        return True

    def _flip(self, notice_id: str) -> None:
        self._timers.pop(notice_id, None)
        notice = self.notices.get(notice_id)
        if notice is not None and notice.canceled_at is None:
            notice.served_at = time.time()
            self._bump()

    def _bump(self) -> None:
        self.version += 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
