"""The one answer to a 409: re-read, re-plan, write again, a bounded number of times.

`retry_on_conflict(attempt, attempts)` calls `attempt()` (which reads the object, plans its
write from what it read and sends the write, conditional on the read resourceVersion) until it
returns without `Conflict`, at most `attempts` times; `on_conflict()` runs after each 409 (to
count it). After the last 409 it raises `TooManyConflicts` (a `Conflict`). Blocking, like the
calls it wraps: run it in a thread.
"""
from __future__ import annotations

from typing import TypeVar
from collections.abc import Callable

from spotguard.kube.api import Conflict

T = TypeVar("T")


class TooManyConflicts(Conflict):
    """The object kept changing under us: 409 on every attempt."""


def retry_on_conflict(attempt: Callable[[], T], attempts: int = 5,
                      on_conflict: Callable[[], None] | None = None) -> T:
    """See the module docstring."""
    for _ in range(max(1, attempts)):
        try:
            return attempt()
        except Conflict:
            if on_conflict is not None:
                on_conflict()
    raise TooManyConflicts(409, f"409 on {max(1, attempts)} attempts in a row")
