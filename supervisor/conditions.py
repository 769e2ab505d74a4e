"""The job conditions that mirror the decision record (pure).

- `SpotguardSuspended`: True while the supervisor keeps the job suspended (phases Suspended,
  GaveUp), reason = the record's reason (BelowMin, Checkpointed, DeadlineReached,
  MaxWaitExceeded), message the suspension's; False with reason `Running`/`Checkpointing`
  otherwise, with a message about the suspension (not suspended; the checkpoint a suspension
  waits for), never the last decision's message, which is about something else (a notice).
- `SpotguardMaxWaitExceeded`: True once the job stopped waiting (phase GaveUp).
- `SpotguardOnDemand`: True while the job runs on on-demand capacity after a fallback
  (fallback.py); False with reason `ReturnedToSpot` once it is back.
Written only once the supervisor has decided something for the job. Other conditions (the job
controller's own) are kept as they are; lastTransitionTime changes only when status changes.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any
from collections.abc import Iterable, Mapping

from spotguard.supervisor.capacity_type import ON_DEMAND
from spotguard.supervisor.record import CHECKPOINTING, GAVE_UP, SUSPENDED, Record
from spotguard.wire import names
from spotguard.wire.notice import format_time

OURS = (names.COND_SUSPENDED, names.COND_MAX_WAIT, names.COND_ON_DEMAND)


def wanted(record: Record) -> list[dict]:
    """Our conditions for `record` (without timestamps); empty before the first decision."""
    if record.decided_at is None:
        return []
    suspended = record.phase in (SUSPENDED, GAVE_UP)
    if suspended:
        reason, message = record.reason or record.phase, record.message
    elif record.phase == CHECKPOINTING:
        reason, message = "Checkpointing", f"suspended once the checkpoint is taken: {record.message}"
    else:
        reason, message = "Running", "spotguard does not keep the job suspended"
    out = [{"type": names.COND_SUSPENDED, "status": "True" if suspended else "False", "reason": reason,
            "message": message[:1024]}]
    if record.phase == GAVE_UP:
        out.append({"type": names.COND_MAX_WAIT, "status": "True", "reason": "MaxWaitExceeded",
                    "message": record.message[:1024]})
    if record.capacity == ON_DEMAND:
        out.append({"type": names.COND_ON_DEMAND, "status": "True", "reason": "FellBackToOnDemand",
                    "message": "running on on-demand capacity until spot capacity returns"})
    elif record.reason == "ReturnedToSpot":
        out.append({"type": names.COND_ON_DEMAND, "status": "False", "reason": "ReturnedToSpot",
                    "message": record.message[:1024]})
    return out


def merged(existing: Iterable[Mapping[str, Any]] | None, record: Record, now: datetime) -> list[dict] | None:
    """The full new conditions list, or None when nothing of ours needs to change."""
    rows: list[dict] = [dict(c) for c in existing or [] if isinstance(c, Mapping)]
    want = {c["type"]: c for c in wanted(record)}
    current = {c.get("type"): c for c in rows if c.get("type") in OURS}
    changed = False
    out = [c for c in rows if c.get("type") not in OURS]
    for ctype in OURS:
        new, old = want.get(ctype), current.get(ctype)
        if new is None:
            if old is not None:
                if old.get("status") != "False":
                    changed = True
                    old = {**old, "status": "False", "reason": "Cleared", "lastTransitionTime": format_time(now)}
                out.append(old)
            continue
        if old is not None and all(old.get(k) == new[k] for k in ("status", "reason", "message")):
            out.append(old)
            continue
        changed = True
        unchanged = old is not None and old.get("status") == new["status"]
        transition = old.get("lastTransitionTime") if old is not None and unchanged else format_time(now)
        out.append({**new, "lastProbeTime": format_time(now), "lastTransitionTime": transition})
    return out if changed else None
