"""Slots for long-lived streams, bounded in all and per client, so one client cannot take them all.

`StreamSlots(max_total, max_per_client)`: `take(client)` returns a `Slot` (release it when the
stream ends; `release()` is idempotent) or raises `SlotRefused` with the HTTP status to answer:
429 when this client already holds `max_per_client` slots, 503 when all `max_total` are
taken. `max_per_client=None` counts only the total (a server whose clients all share one
address, such as the sidecar on loopback). One event loop; no locking needed.
"""
from __future__ import annotations


class SlotRefused(Exception):
    """No slot for this client; `status` is 429 (its share is used up) or 503 (no slot left)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Slot:
    """One taken slot; `release()` gives it back (once)."""

    def __init__(self, owner: StreamSlots, client: str):
        self._owner = owner
        self.client = client
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._give_back(self.client)


class StreamSlots:
    """See the module docstring."""

    def __init__(self, max_total: int, max_per_client: int | None = None):
        if max_total < 1 or (max_per_client is not None and not 1 <= max_per_client <= max_total):
            raise ValueError("need max_total >= 1 and 1 <= max_per_client <= max_total")
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.total = 0
        self._by_client: dict[str, int] = {}

    def held_by(self, client: str) -> int:
        return self._by_client.get(client, 0)

    def take(self, client: str) -> Slot:
        if self.max_per_client is not None and self.held_by(client) >= self.max_per_client:
            raise SlotRefused(429, f"this client already holds {self.max_per_client} streams")
        if self.total >= self.max_total:
            raise SlotRefused(503, "too many subscribers")
        self.total += 1
        self._by_client[client] = self.held_by(client) + 1
        return Slot(self, client)

    def _give_back(self, client: str) -> None:
        self.total -= 1
        left = self.held_by(client) - 1
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
