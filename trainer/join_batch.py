"""Which started joiners the dry-run's supervisor admits, and when: one membership for all the
joiners that are ready close together, so three returns make one change to 4, not three.

Contract (pure, times passed in): `started(node, now)` for each joiner started, `ready(node, now)`
once its ready file exists, `drop(node)` when it ended or must not be admitted. `due(now)` names
the joiners to admit now: every ready one, once no started joiner is still unready, or once the
first ready one has waited `window` seconds (a slow joiner holds the others back at most that
long; it is admitted with a later membership). `admitted(nodes)` forgets them.
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

    def drop(self, node: str) -> None:
        self.pending.pop(node, None)
        self._ready.pop(node, None)

    def due(self, now: float) -> list[str]:
        if not self._ready:
            return []
        if len(self._ready) == len(self.pending) or now - min(self._ready.values()) >= self.window:
            return sorted(self._ready, key=lambda n: (self.pending[n], n))
        return []

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
