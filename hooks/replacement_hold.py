"""The hold before leave: a rank with a notice keeps training while its replacement is on its way.

Pure policy: no I/O, no torch, no clock of its own (times are POSIX seconds passed in).

Why: with warm standby the supervisor asks for the noticed member's replacement at once, but the
replacement needs seconds to start. A rank that leaves at once leaves the job one short for
those seconds at every reclaim; a rank that trains on until the replacement joins is swapped for
it in ONE in-place change (the membership that admits the joiner leaves it out), the way a
swap-back replaces an on-demand member.

Contract:
- `release_at(...)` returns None when the notice is acted on now, exactly as without a hold:
  no replacement is coming, the notice has no deadline, the rank has no save estimate (it never
  measured a save: nothing says a save would still fit later, so it does not gamble), or the
  deadline is too short to hold (the latest safe moment is not after `now`). Otherwise the
  latest safe moment, a POSIX time:
  deadline - the save estimate - `step_seconds` (the boundary at which the released notice is
  agreed comes up to one step later) - `margin_seconds` (the save decision's margin plus the
  hold's own).
  Released then, the agreed step's durable checkpoint still fits before the deadline by the
  same rule `save_decision` applies.
- Which notices a warm standby answers (a departure from a node's monitors) is the one notice
  policy's `answered_by_standby` (`spotguard.wire.notice_policy`); the caller asks it first.
- The hold ends earlier when the membership that swaps the rank for its replacement is agreed
  (the Guard's in-place change); that is not decided here.
"""
from __future__ import annotations

HOLD_MARGIN_SECONDS = 1.0  # on top of the save decision's margin: the agreement, the leaving rank's handover


def release_at(*, now: float, deadline: float | None, replacement_coming: bool, save_estimate: float | None,
               step_seconds: float, margin_seconds: float) -> float | None:
    """See the module docstring. `deadline`: POSIX seconds (None: no deadline)."""
    if not replacement_coming or deadline is None or save_estimate is None:
        return None
    safe = deadline - save_estimate - max(0.0, step_seconds) - max(0.0, margin_seconds)
    return safe if safe > now else None
