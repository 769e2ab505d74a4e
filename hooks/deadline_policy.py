"""When the deadline watchdog acts, and what it does then. Pure policy: times passed in, no I/O.

The watchdog (`hooks/deadline_watchdog.py`) runs beside the notice listener in every rank. A
notice's deadline arms it; the agreed step at a boundary normally answers the notice first. If
the ranks have not agreed by the latest safe moment, the watchdog persists the newest in-memory
snapshot itself and the rank leaves before the deadline.

- `act_at(deadline, persist_estimate, margin)`: the latest safe moment to start persisting the
  held snapshot: deadline - persist estimate (the slowest recent persist, 1.25x; `DEFAULT_PERSIST`
  before any was measured) - margin - the exit reserve. Never before `now`.
- `leave_by(deadline)`: when the last-resort timer ends the process (no Python needed):
  deadline - `EXIT_RESERVE`, so the process is gone before the kubelet's kill.
- `plan(...)`: at the moment the watchdog wakes, one of `Plan`: LEAVE_NOW (nothing trained since
  the newest durable checkpoint: leave at once, nothing lost), WAIT (not yet the latest safe
  moment), PERSIST (persist the held snapshot now), NOTHING_TO_PERSIST (new work but no snapshot:
  the boundary is the only hope; the last-resort timer ends the rank with 84 if it never comes).
"""
from __future__ import annotations

import enum

EXIT_RESERVE = 0.5  # seconds kept between the last-resort exit and the deadline
DEFAULT_PERSIST = 2.0  # a persist never measured: assumed to take this long
ESTIMATE_FACTOR = 1.25  # as the adapters' own save estimate


class Plan(enum.Enum):
    LEAVE_NOW = "leave-now"
    WAIT = "wait"
    PERSIST = "persist"
    NOTHING_TO_PERSIST = "nothing-to-persist"


def act_at(deadline: float, persist_estimate: float | None, margin: float) -> float:
    """The latest safe moment to start the watchdog's persist (same clock as `deadline`)."""
    persist = DEFAULT_PERSIST if persist_estimate is None else ESTIMATE_FACTOR * persist_estimate
    return deadline - persist - max(margin, 0.0) - EXIT_RESERVE


def leave_by(deadline: float) -> float:
    """When the last-resort timer ends the process."""
    return deadline - EXIT_RESERVE


def new_work(completed_step: int | None, durable_step: int | None) -> bool:
    """Whether a step was completed since the newest durable checkpoint this process knows of
    (`completed_step` None: no step completed in this process yet)."""
    if completed_step is None:
        return False
    return durable_step is None or completed_step > durable_step


def plan(now: float, deadline: float, *, completed_step: int | None, durable_step: int | None,
         snapshot_step: int | None, persist_estimate: float | None, margin: float) -> Plan:
    """What the watchdog does at `now` for a notice due at `deadline` (module docstring)."""
    if not new_work(completed_step, durable_step):
        return Plan.LEAVE_NOW
    if now < act_at(deadline, persist_estimate, margin):
        return Plan.WAIT
    if snapshot_step is None or (durable_step is not None and snapshot_step <= durable_step):
        return Plan.NOTHING_TO_PERSIST
    return Plan.PERSIST
