"""The Guard's notice gate: which notice the ranks must agree on now, which wait, which never count.

Pure policy: no I/O, no torch, no clock of its own (what depends on time takes `now`). Safe to
call from the listener thread and the training loop at once.

Contract:
- `offer(notice, now)` reads the notice through the one notice policy
  (`spotguard.wire.notice_policy.read`, with `act_on` and `horizon_seconds`) and returns a
  `Decision`:
  IGNORE when it reads as advice (an advisory, a rebalance, a kind not in `act_on`), or when
  its id is answered (by the checkpoint the job resumed from, or by a finished drain: a re-sent
  or updated copy never drains again; a re-created instance's notice has another id);
  HOLD when it reads as held (its deadline is more than `horizon_seconds` after `now`: kept
  until `release_due` finds it within the horizon, or a withdrawal drops it), or when the gate's `hold(notice,
  now)` gives a release time after `now` (a replacement is on its way: `replacement_hold`; kept
  until `release_due` reaches that time, or a withdrawal drops it; every copy offered again is
  asked again and its release time never moves later: a copy for which `hold` gives None, e.g.
  no replacement is coming any more, is acted on; a notice the horizon releases is asked too);
  ACT otherwise: it joins the notices to act on (a copy with the same id replaces the one kept),
  and `pending` is the most urgent of them: the earliest deadline (no deadline counts as
  infinitely late; a tie keeps the one that came first). The others wait behind it: withdrawn,
  the next becomes `pending` (a later notice dropped then would never come again: the stream
  sends a notice once).
- `release_due(now)` offers the held notices whose deadline has come within the horizon, or
  whose hold's release time has come (those are acted on, never held again), and returns them.
- `withdraw(notice_id)` drops a held notice or one to act on (the ranks have not agreed on it
  yet); it returns where it was found ("held", "pending"; empty when nowhere).
- `answered(notice_id)` marks an id answered and drops it from the notices to act on;
  `is_answered(notice_id)` says whether it was (the deadline watchdog asks the same).
"""
from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass
from datetime import datetime
from collections.abc import Callable, Iterable

from spotguard.wire import notice_policy
from spotguard.wire.notice import Kind, Notice

ACT_ON = notice_policy.DEPARTING_KINDS


class Action(enum.Enum):
    ACT = "act"  # pending now (or less urgent than the pending one): agreed at the next boundary
    HOLD = "hold"  # deadline beyond the horizon
    IGNORE = "ignore"  # never acted on


@dataclass(frozen=True)
class Decision:
    """What `offer` did and why: `why` is "advisory", "kind", "answered" (IGNORE), "new" or "again" (HOLD: held
    for the first time or already held), "replacement" (HOLD: until `release_ts`, a replacement is on its
    way), "" (ACT). `seconds_left` is the notice's time to its deadline."""

    action: Action
    why: str = ""
    seconds_left: float | None = None
    release_ts: float | None = None  # a replacement hold's release time (POSIX seconds)


def deadline_ts(notice: Notice) -> float:
    """The notice's deadline as a POSIX timestamp; infinity without one (least urgent)."""
    return notice.deadline.timestamp() if notice.deadline is not None else math.inf


class NoticeGate:
    """See the module docstring."""

    def __init__(self, act_on: Iterable[Kind] = ACT_ON, horizon_seconds: float = notice_policy.HORIZON_SECONDS,
                 hold: Callable[[Notice, datetime], float | None] | None = None):
        self.act_on = frozenset(act_on)
        self.horizon_seconds = horizon_seconds
        self.hold = hold
        self._lock = threading.Lock()
        self._acting: dict[str, Notice] = {}  # the notices to act on, in the order they came
        self._pending: Notice | None = None  # the most urgent of them
        self._held: dict[str, Notice] = {}
        self._release: dict[str, float] = {}  # id -> release time of a notice held for its replacement
        self._answered: set[str] = set()

    @property
    def pending(self) -> Notice | None:
        """The most urgent notice to agree on now, or None."""
        return self._pending

    @property
    def holding(self) -> bool:
        """True while any notice is held beyond the horizon."""
        return bool(self._held)

    def held_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._held)

    def offer(self, notice: Notice, now: datetime) -> Decision:
        return self._offer(notice, now, may_hold=True)

    def _offer(self, notice: Notice, now: datetime, may_hold: bool) -> Decision:
        reading = notice_policy.read(notice, now, horizon_seconds=self.horizon_seconds, departing=self.act_on)
        if reading.meaning is notice_policy.Meaning.ADVICE:
            return Decision(Action.IGNORE, reading.why)
        if self.is_answered(notice.id):
            return Decision(Action.IGNORE, "answered")
        left = notice.seconds_left(now)
        release = self.hold(notice, now) if may_hold and self.hold is not None else None
        with self._lock:
            if reading.meaning is notice_policy.Meaning.HELD:
                why = "again" if notice.id in self._held else "new"
                self._held[notice.id] = notice
                return Decision(Action.HOLD, why, left)
            if release is not None:
                release = min(release, self._release.get(notice.id, math.inf))
                if release > now.timestamp():
                    self._held[notice.id] = notice
                    self._release[notice.id] = release
                    return Decision(Action.HOLD, "replacement", left, release)
            self._held.pop(notice.id, None)
            self._release.pop(notice.id, None)
            self._acting[notice.id] = notice
            self._settle()
        return Decision(Action.ACT, "", left)

    def release_due(self, now: datetime) -> list[Notice]:
        ts = now.timestamp()
        with self._lock:
            due = [(n, n.id in self._release) for n in self._held.values()
                   if (self._release[n.id] <= ts if n.id in self._release
                       else notice_policy.read(n, now, horizon_seconds=self.horizon_seconds).meaning
                       is not notice_policy.Meaning.HELD)]
        for notice, was_replacement_hold in due:
            self._offer(notice, now, may_hold=not was_replacement_hold)
        return [n for n, _ in due]

    def withdraw(self, notice_id: str) -> tuple[str, ...]:
        found = []
        with self._lock:
            self._release.pop(notice_id, None)
            if self._held.pop(notice_id, None) is not None:
                found.append("held")
            if self._acting.pop(notice_id, None) is not None:
                self._settle()
                found.append("pending")
        return tuple(found)

    def is_answered(self, notice_id: str) -> bool:
        """Whether an agreed step answered `notice_id` (the deadline watchdog asks too)."""
        return notice_id in self._answered

    def answered(self, notice_id: str) -> None:
        self._answered.add(notice_id)
        with self._lock:
            if self._acting.pop(notice_id, None) is not None:
                self._settle()

    def _settle(self) -> None:
        """Under the lock: `pending` is the most urgent notice to act on (a tie: the first)."""
        self._pending = min(self._acting.values(), key=deadline_ts, default=None)
