"""The one urgency order of notices, used wherever notices are ranked (agent table, sidecar
live set, preStop). The Node's mark, which stands for every job on the node, ranks by
`notice_policy.departure_order` instead (a departing kind before an advisory due sooner).

Most urgent first: the earliest deadline first, notices without a deadline last; ties broken
by detection time, then by id, so the order is total and the same on every node and hop.
"""
from __future__ import annotations

from datetime import datetime, UTC
from collections.abc import Iterable

from spotguard.wire.notice import Notice

_FAR_FUTURE = datetime.max.replace(tzinfo=UTC)


def deadline_key(notice: Notice) -> tuple[bool, datetime]:
    """Earliest deadline first, no deadline last (no tie-breaker: for picking among reports
    of one event, where the caller adds its own)."""
    return (notice.deadline is None, notice.deadline or _FAR_FUTURE)


def urgency_key(notice: Notice) -> tuple[bool, datetime, datetime, str]:
    """The sort key of the urgency order (module docstring)."""
    return (*deadline_key(notice), notice.detected_at, notice.id)


def most_urgent_first(notices: Iterable[Notice]) -> list[Notice]:
    """`notices` sorted most urgent first."""
    return sorted(notices, key=urgency_key)


def most_urgent(notices: Iterable[Notice]) -> Notice | None:
    """The most urgent of `notices`, or None when there is none."""
    return min(notices, key=urgency_key, default=None)
