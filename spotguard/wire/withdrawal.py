"""The withdrawal: a notice taken back (a canceled maintenance, a cleared taint), and its wire form.

Wire form: `{"v": 1, "withdrawn": "<notice id>", "source": ..., "node": ..., "reason": ...}`.
`parse_withdrawal` rejects another version or a missing/empty id (NoticeFormatError naming the
field); `source`, `node` and `reason` default to "unknown", "unknown" and "withdrawn" when
absent, but must be non-empty strings when given. Unknown extra fields are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotguard.wire.fields import versioned_object
from spotguard.wire.notice import MAX_NOTICE_ID, WIRE_VERSION, Notice, NoticeFormatError


@dataclass(frozen=True)
class Withdrawal:
    """The cloud took a notice back (a canceled maintenance, a cleared taint)."""

    notice_id: str
    source: str
    node: str
    reason: str = "withdrawn"

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "withdrawn": self.notice_id, "source": self.source, "node": self.node,
                "reason": self.reason}


Update = Notice | Withdrawal
"""A change to a set of notices: a new or changed notice, or the withdrawal of one (what a
source yields, what the agent's table publishes)."""


def parse_withdrawal(obj: Any) -> Withdrawal:
    """A withdrawal wire object; NoticeFormatError names the bad field."""
    obj = versioned_object(obj, WIRE_VERSION, NoticeFormatError, "withdrawal", "wire version")
    notice_id = obj.get("withdrawn")
    if not isinstance(notice_id, str) or not notice_id or len(notice_id) > MAX_NOTICE_ID:
        raise NoticeFormatError(f"withdrawn: expected a notice id, got {notice_id!r:.80}")
    fields = {}
    for name, default in (("source", "unknown"), ("node", "unknown"), ("reason", "withdrawn")):
        value = obj.get(name, default)
        if not isinstance(value, str) or not value:
            raise NoticeFormatError(f"{name}: expected a non-empty string, got {value!r:.80}")
        fields[name] = value
    return Withdrawal(notice_id, **fields)
