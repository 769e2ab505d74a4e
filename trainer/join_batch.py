"""Which started joiners the dry-run's supervisor admits, and when: one membership for all the
joiners that are ready close together, so three returns make one change to 4, not three.

Contract (pure, times passed in): `started(node, now)` for each joiner started, `ready(node, now)`
once its ready file exists, `drop(node)` when it ended or must not be admitted. `due(now)` names
the joiners to admit now: every ready one, once no started joiner is still unready, or once the
first ready one has waited `window` seconds (a slow joiner holds the others back at most that
long; it is admitted with a later membership), or at once when no unready joiner is expected
ready within that window: joiners take about as long to start, so one started later than the
fastest ready one by more than the window's remaining time is not waited for (a backfill
standby started at a notice does not wait for a spot joiner asked for seconds later).
`admitted(nodes)` forgets them.
"""
from __future__ import annotations

DEFAULT_WINDOW = 5.0


class JoinBatch:
    def __init__(self, window: float = DEFAULT_WINDOW):
        self.window = window
        self.pending: dict[str, float] = {}  # node -> when its joiner started
        self._ready: dict[str, float] = {}  # node -> when it was first seen ready

    def started(self, node: str, now: float) -> None:
        self.pending[node] = now
        self._ready.pop(node, None)

    def ready(self, node: str, now: float) -> None:
        if node in self.pending:
            self._ready.setdefault(node, now)

    def is_ready(self, node: str) -> bool:
        return node in self._ready

    def ready_at(self, node: str) -> float | None:
        """When `node`'s joiner was first seen ready (None: not yet, or not pending)."""
        return self._ready.get(node)

    def drop(self, node: str) -> None:
        self.pending.pop(node, None)
        self._ready.pop(node, None)

    def due(self, now: float) -> list[str]:
        if not self._ready:
            return []
        first = min(self._ready.values())
        if len(self._ready) == len(self.pending) or now - first >= self.window \
                or self._expected_ready(first) > first + self.window:
            return sorted(self._ready, key=lambda n: (self.pending[n], n))
        return []

    def _expected_ready(self, first: float) -> float:
        """When the soonest unready joiner is expected ready: its start plus the quickest start-up seen."""
        startup = min(at - self.pending[n] for n, at in self._ready.items())
        return min(self.pending[n] for n in self.pending if n not in self._ready) + startup

    def admitted(self, nodes: list[str]) -> None:
        for node in nodes:
            self.drop(node)

    def clear(self) -> list[str]:
        """Forgets every joiner; returns the nodes it had."""
        nodes = list(self.pending)
        self.pending.clear()
        self._ready.clear()
        return nodes

    def __contains__(self, node: str) -> bool:
        return node in self.pending

    def __len__(self) -> int:
        return len(self.pending)
