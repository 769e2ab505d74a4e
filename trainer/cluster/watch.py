"""One watch on the local API: the events of one resource after a resourceVersion, as the
iterable a thread reads and any thread can close (`spotguard.kube.api.WatchStream`'s contract).

The API puts events in with `offer()` (under its lock, so in the order it applied the writes);
iterating yields them as `{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}` until
`close()` or the watch's timeout, then ends (the caller watches again from the last version it
saw, as with a real server). An object that stops matching the watch's label or field selector
is delivered as DELETED, one that starts matching as ADDED (the API server's rule).
"""
from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Mapping
from typing import Any

from spotguard.trainer.cluster.selectors import matches

_CLOSED = object()


class LocalWatch:
    """See the module docstring. `namespace` None: every namespace."""

    def __init__(self, resource_key: str, namespace: str | None, labels: Mapping[str, str] | None,
                 fields: list[tuple[str, str, bool]], timeout_seconds: float):
        self.resource_key = resource_key
        self.namespace = namespace
        self.labels = dict(labels or {})
        self.fields = fields
        self.closed = False
        self._ends_at = time.monotonic() + timeout_seconds
        self._queue: queue.Queue[Any] = queue.Queue()

    def wants(self, resource_key: str, namespace: str) -> bool:
        return resource_key == self.resource_key and (self.namespace is None or namespace == self.namespace)

    def offer(self, kind: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        """Queues the event a write made (old and new object; None where there is none)."""
        was = old is not None and matches(old, self.labels, self.fields)
        now = new is not None and matches(new, self.labels, self.fields)
        if kind == "DELETED":
            if was:
                self._queue.put({"type": "DELETED", "object": old})
        elif now:
            self._queue.put({"type": "ADDED" if kind == "ADDED" or not was else "MODIFIED", "object": new})
        elif was:
            self._queue.put({"type": "DELETED", "object": new})

    def error(self, code: int, message: str) -> None:
        self._queue.put({"type": "ERROR", "object": {"kind": "Status", "code": code, "message": message}})
        self._queue.put(_CLOSED)

    def close(self) -> None:
        self.closed = True
        self._queue.put(_CLOSED)

    def __iter__(self) -> Iterator[dict]:
        while not self.closed:
            left = self._ends_at - time.monotonic()
            if left <= 0:
                return
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                return
            if item is _CLOSED:
                return
            yield item
