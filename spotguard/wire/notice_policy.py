"""What a notice means at a given time: the one rule every part of spotguard applies.

The Guard's gate, the supervisor (which notices hit a job, who stays a member, when to look
again), the warm standby and the dry-run's report all read a notice through `read`, so they
can never disagree about whether a node is leaving.

Pure: no I/O, no clock of its own (`now` is passed in), no state.

A notice reads as one of three meanings:
- ADVICE: information, never a departure. An advisory (`Severity.ADVISORY`), or a kind that
  announces a risk rather than a departure (`rebalance`), or a kind the reader does not act on.
  Its node keeps its members and its replicas count as survivors.
- HELD: a departing kind whose deadline is more than `horizon_seconds` after `now`. Nothing
  acts on it until `release_at` (deadline - horizon); withdrawn before then (a maintenance the
  cloud cancels), nothing ever did. A reader that sees a held notice looks again at `release_at`.
- DEPARTURE: the node goes at the notice's deadline (no deadline: any moment). Its ranks agree
  on a step and checkpoint, its pods stop being members and survivors.
Whatever its meaning, a node with a notice is no longer free capacity for new replicas (that
rule is the supervisor's `capacity` module: a marked node gets nothing new).

`DEPARTING_KINDS` are the kinds that take a node away; a reader may act on fewer (the Guard's
`act_on` setting narrows it, never widens it past what the caller passes).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta
from collections.abc import Iterable

from spotguard.wire import names
from spotguard.wire.notice import Kind, Notice

HORIZON_SECONDS = 120.0  # AWS's lead time: a reclaim is acted on at once, a maintenance an hour out is not
DEPARTING_KINDS = frozenset({Kind.RECLAIM, Kind.MAINTENANCE, Kind.GPU_FAULT, Kind.DRAIN})
# Notices that do not come from a node's monitors: a rank's own signal, the supervisor's job-wide
# drain (return to spot) and a pushed membership. No warm standby answers them.
_NOT_FROM_A_NODE = frozenset({names.SIGNAL_SOURCE, names.SUPERVISOR_DRAIN_SOURCE, names.MEMBERSHIP_SOURCE})


class Meaning(enum.StrEnum):
    """See the module docstring."""

    ADVICE = "advice"
    HELD = "held"
    DEPARTURE = "departure"


@dataclass(frozen=True)
class Reading:
    """A notice's meaning at one time. `release_at`: when a HELD notice becomes a departure
    (None otherwise). `why` (ADVICE only): "advisory" (its severity) or "kind" (not departing)."""

    meaning: Meaning
    release_at: datetime | None = None
    why: str = ""

    @property
    def departs(self) -> bool:
        return self.meaning is Meaning.DEPARTURE


def announces_departure(notice: Notice) -> bool:
    """Whether `notice`, by its severity and kind alone, says its node goes (some time): not an
    advisory, a departing kind. `read` adds the time (held until the horizon) and the kinds a
    reader acts on; a reader that follows which nodes are leaving, whenever, asks this."""
    return not notice.advisory and notice.kind in DEPARTING_KINDS


def read(notice: Notice, now: datetime, *, horizon_seconds: float = HORIZON_SECONDS,
         departing: Iterable[Kind] = DEPARTING_KINDS) -> Reading:
    """What `notice` means at `now` (module docstring). `departing`: the kinds this reader acts
    on (default every departing kind)."""
    if notice.advisory:
        return Reading(Meaning.ADVICE, why="advisory")
    if not announces_departure(notice) or notice.kind not in frozenset(departing):
        return Reading(Meaning.ADVICE, why="kind")
    if notice.deadline is not None:
        try:
            release = notice.deadline - timedelta(seconds=horizon_seconds)
        except OverflowError:  # a horizon beyond the calendar: every notice is within it
            return Reading(Meaning.DEPARTURE)
        if now < release:
            return Reading(Meaning.HELD, release_at=release)
    return Reading(Meaning.DEPARTURE)


def departure_order(notice: Notice) -> tuple[bool, bool, datetime, datetime, str]:
    """A sort key, soonest to depart first, whatever the reader's horizon: a notice that
    announces a departure before one that does not; among those, one without a deadline (any
    moment) first, then the earliest deadline (under any horizon it is released first); ties by
    detection time, then id. Where one notice must stand for a node (the Node's mark), the first
    in this order is a departure for every job that reads any of them as one."""
    far = datetime.max.replace(tzinfo=notice.detected_at.tzinfo)
    return (not announces_departure(notice), notice.deadline is not None, notice.deadline or far,
            notice.detected_at, notice.id)


def departs(notice: Notice | None, now: datetime, *, horizon_seconds: float = HORIZON_SECONDS) -> bool:
    """True when `notice` (None: no notice) reads as a departure at `now`."""
    return notice is not None and read(notice, now, horizon_seconds=horizon_seconds).departs


def departing_nodes(noticed: Iterable[tuple[str, Notice | None]], now: datetime, *,
                    horizon_seconds: float = HORIZON_SECONDS) -> frozenset[str]:
    """Who is leaving: the nodes of `noticed`, (node, its notice or None) pairs, whose notice
    reads as a departure at `now` (the supervisor's job reading and the sidecar's hostfile)."""
    return frozenset(node for node, notice in noticed if departs(notice, now, horizon_seconds=horizon_seconds))


def next_release(notices: Iterable[Notice | None], now: datetime, *,
                 horizon_seconds: float = HORIZON_SECONDS) -> datetime | None:
    """The earliest time one of `notices` held at `now` becomes a departure (None: none held):
    when a reader that acts on departures must look again."""
    times = [r.release_at for n in notices if n is not None
             for r in (read(n, now, horizon_seconds=horizon_seconds),) if r.release_at is not None]
    return min(times, default=None)


def answered_by_standby(notice: Notice) -> bool:
    """Whether a warm standby can answer `notice`: a departing kind reported by a node's monitors
    (the supervisor places a replacement for the departing member; the member's ranks may train
    on until it joins: `hooks/replacement_hold.py`). Not a rank's own signal, the supervisor's
    job-wide drain or a pushed membership."""
    return announces_departure(notice) and notice.source not in _NOT_FROM_A_NODE
