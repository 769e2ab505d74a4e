"""The interface every notice source implements, and the loop that runs it.

A source watches one signal (an IMDS path, a hanging GET, a Node object, NVML) and reports
the complete set of notices that signal shows now. `Source.run()` turns successive reports
into updates: a new or changed notice is yielded as a `Notice`, one that disappears from a
successful report as a `Withdrawal`. A failed read never withdraws anything.

Contract of `run()`: it never raises out of its loop (only cancellation ends it), counts every
failure in `stats.errors` by reason, waits after a failure as `retry.RetryPolicy` says (at
most the interval + 1 s, except after throttling, which waits as the server asks, bounded),
and keeps the first `detected_at` of a notice for as long as it stays live.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator

from spotguard.agent.sources.retry import RetryPolicy
from spotguard.backoff import Backoff
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Update, Withdrawal

log = logging.getLogger(__name__)


class SourceError(Exception):
    """A read gave no clean answer. `reason` is a short label for metrics (timeout, http_503...);
    `retry_after` the seconds the server asked us to wait (a 429's Retry-After), if it did."""

    def __init__(self, reason: str, message: str = "", retry_after: float | None = None):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class SourceStats:
    """Counters a source keeps about itself; the agent exports them as metrics."""

    polls: int = 0
    successes: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    last_error: str | None = None
    last_success_monotonic: float | None = None


class Source(abc.ABC):
    """One monitor of one signal on one node.

    Subclasses set `name` (e.g. "aws.spot") and implement `poll()`. `interval` is the pause
    between reads; a source whose read blocks until something changes (GCP's hanging GET, a
    Kubernetes watch) uses 0. `backoff`, if given, replaces the transient-failure schedule.
    """

    name: str = "source"

    def __init__(self, node: str, interval: float, backoff: Backoff | None = None):
        self.node = node
        self.interval = interval
        self.retry = RetryPolicy(interval, transient=backoff)
        self.stats = SourceStats()
        self._live: dict[str, Notice] = {}

    @abc.abstractmethod
    async def poll(self) -> list[Notice]:
        """Reads the signal once; returns every notice it shows now (empty when none).

        Raises SourceError when there is no clean answer; the previous set then stays live.
        """

    async def close(self) -> None:
        """Releases connections and threads. Called once when `run()` ends."""

    @property
    def live(self) -> dict[str, Notice]:
        """The notices from the last successful read, by id."""
        return dict(self._live)

    def reconcile(self, current: list[Notice]) -> list[Update]:
        """Diffs a successful read against the previous one; returns the updates to yield."""
        updates: list[Update] = []
        seen: dict[str, Notice] = {}
        for notice in current:
            previous = self._live.get(notice.id)
            if previous is not None:
                notice = Notice(**{**notice.__dict__, "detected_at": previous.detected_at})
                if not previous.same_event(notice):
                    updates.append(notice)
            elif notice.id not in seen:
                updates.append(notice)
            seen[notice.id] = notice
        for gone in self._live.keys() - seen.keys():
            updates.append(Withdrawal(gone, self.name, self.node))
        self._live = seen
        return updates

    async def run(self) -> AsyncIterator[Update]:
        """Polls forever, yielding updates; see the module docstring for the contract."""
        try:
            while True:
                self.stats.polls += 1
                try:
                    current = await self.poll()
                except asyncio.CancelledError:
                    raise
                except SourceError as exc:
                    delay = self._failed(exc.reason, str(exc), exc.retry_after)
                except Exception as exc:  # a bug or an unexpected library error: count it, go on
                    log.exception("source %s: unexpected error", self.name)
                    delay = self._failed("internal", repr(exc))
                else:
                    self.stats.successes += 1
                    self.stats.last_success_monotonic = time.monotonic()
                    self.retry.reset()
                    for update in self.reconcile(current):
                        yield update
                    delay = self.interval
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
        finally:
            await self.close()

    def _failed(self, reason: str, message: str, retry_after: float | None = None) -> float:
        self.stats.errors[reason] += 1
        self.stats.last_error = message
        delay = self.retry.after_failure(reason, retry_after)
        log.warning("source %s: %s; retrying in %.2fs", self.name, message, delay,
                    extra={"source": self.name, "reason": reason})
        return delay
