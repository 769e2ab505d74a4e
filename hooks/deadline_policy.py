"""When the deadline watchdog acts, and what it does then. Pure policy: times passed in, no I/O.

The watchdog (`hooks/deadline_watchdog.py`) runs beside the notice listener in every rank. A
notice's deadline arms it; the agreed step at a boundary normally answers the notice first. If
the ranks have not agreed by the latest safe moment, the watchdog persists the newest in-memory
snapshot itself and the rank leaves before the deadline.

- `act_at(deadline, persist_estimate, margin)`: the latest safe moment to start persisting the
  held snapshot: deadline - persist estimate (the slowest recent persist, 1.25x; `DEFAULT_PERSIST`
  before any was measured) - margin - the departure's own time (`FINISH_SECONDS`: the
  termination message, the report, the peers) - the exit reserve.
- `leave_by(deadline, armed_at)`: when the last-resort timer ends the process (no Python needed):
  deadline - `EXIT_RESERVE`, so the process is gone before the kubelet's kill; never sooner than
  `MIN_LEAD` after the notice arrived (a notice that came too late for its own deadline still
  gets the time to save what it can).
- `not_before(armed_at, step_seconds)`: the watchdog never acts sooner than `BOUNDARY_STEPS` steps
  (and `BOUNDARY_SECONDS`) after the notice arrived: with short steps, the boundary's agreed save (a
  fresher step) comes first even when the latest safe moment has passed already; with nothing new
  here, a peer that completed the step this rank is finishing answers it at its boundary.
- `plan(...)`: at the moment the watchdog wakes, one of `Plan`: LEAVE_NOW (nothing trained since
  the newest durable checkpoint: leave at once, nothing lost), WAIT (not yet the latest safe
  moment, or the boundary may still come first), PERSIST (persist the held snapshot now),
  NOTHING_TO_PERSIST (new work but no snapshot: the boundary is the only hope; the last-resort
  timer ends the rank with 84 if it never comes).
"""
from __future__ import annotations

import enum

EXIT_RESERVE = 0.5  # seconds kept between the last-resort exit and the deadline
FINISH_SECONDS = 1.5  # the departure after the persist: message, report, peers, exit
MIN_LEAD = 5.0  # seconds a notice always gets before the last-resort exit
BOUNDARY_STEPS = 3.0  # steps the watchdog leaves the boundary after a notice arrives
BOUNDARY_SECONDS = 1.0  # ... and at least this long
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
    return deadline - persist - max(margin, 0.0) - FINISH_SECONDS - EXIT_RESERVE


def leave_by(deadline: float, armed_at: float) -> float:
    """When the last-resort timer ends the process (module docstring)."""
    return max(deadline - EXIT_RESERVE, armed_at + MIN_LEAD)


def not_before(armed_at: float, step_seconds: float) -> float:
    """The watchdog's earliest action for a notice that arrived at `armed_at` (module docstring)."""
    return armed_at + max(BOUNDARY_STEPS * step_seconds, BOUNDARY_SECONDS)


def new_work(completed_step: int | None, durable_step: int | None) -> bool:
    """Whether a step was completed since the newest durable checkpoint this process knows of
    (`completed_step` None: no step completed in this process yet)."""
    if completed_step is None:
        return False
    return durable_step is None or completed_step > durable_step


def plan(now: float, deadline: float, *, completed_step: int | None, durable_step: int | None,
         snapshot_step: int | None, persist_estimate: float | None, margin: float, earliest: float = 0.0) -> Plan:
    """What the watchdog does at `now` for a notice due at `deadline`, never acting before
    `earliest` (`not_before`), even with nothing new to save here: a peer may have completed the
    step this rank is finishing, and its boundary answers the notice then (module docstring)."""
    if now < earliest:
        return Plan.WAIT
    if not new_work(completed_step, durable_step):
        return Plan.LEAVE_NOW
    if now < act_at(deadline, persist_estimate, margin):
        return Plan.WAIT
    if snapshot_step is None or (durable_step is not None and snapshot_step <= durable_step):
        return Plan.NOTHING_TO_PERSIST
    return Plan.PERSIST
