"""How long a polled source waits after a failed read.

Detection after a fault is what matters, so a transient failure (timeout, 5xx, a dropped
connection, a corrupt body: every reason but throttling) costs at most one more interval:
the wait is the interval (metadata services are local to the node: there is no crowd of
clients to spread out), or, for a source that blocks in its reads (interval 0, such as GCP's
hanging GET), a short backoff with jitter of at most `TRANSIENT_CAP` (1 s), so a failing
server is never hammered in a loop. In every case the wait is <= interval + 1 s.

Throttling (HTTP 429, reason "http_429") is the one case for a longer wait: the server's
`Retry-After` when it sent one, else an exponential backoff with jitter; either way at least
the interval and at most `THROTTLE_CAP` (30 s; the interval if that is longer). Any successful
read resets both schedules. A source may bring its own transient `Backoff` (the GPU source
does, for NVML errors): the bound above is then that backoff's.
"""
from __future__ import annotations

import random

from spotguard.backoff import Backoff

TRANSIENT_CAP = 1.0
THROTTLE_CAP = 30.0
THROTTLED = "http_429"


class RetryPolicy:
    """`after_failure(reason, retry_after)` -> seconds to wait; `reset()` after a success."""

    def __init__(self, interval: float, transient: Backoff | None = None, rng: random.Random | None = None):
        self.interval = interval
        self._transient = transient if transient is not None or interval > 0 else \
            Backoff(base=0.1, cap=TRANSIENT_CAP, rng=rng)
        self._throttle_cap = max(THROTTLE_CAP, interval)
        self._throttled = Backoff(base=max(interval, 1.0), cap=self._throttle_cap, rng=rng)

    def after_failure(self, reason: str, retry_after: float | None = None) -> float:
        if reason == THROTTLED:
            wanted = retry_after if retry_after is not None else self._throttled.next_delay()
            return min(self._throttle_cap, max(self.interval, wanted))
        if self._transient is None:
            return self.interval
        return max(self.interval, self._transient.next_delay())

    def reset(self) -> None:
        if self._transient is not None:
            self._transient.reset()
        self._throttled.reset()
