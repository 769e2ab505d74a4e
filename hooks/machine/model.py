"""The agreed-step machine's vocabulary, pure: its phases, the roles a rank takes, the outcomes,
and the one record of an agreed step (what it saved, and for a change, what became of the group).

- `Phase`: agreed -> decided -> checkpointed -> handover -> durable -> left -> formed -> rebuilt
  -> transferred -> committed -> departed, in the order `machine.table.TABLE` walks them.
  `CHANGE_PHASES` are the ones of an in-place change (what `@guard.on_resize_phase` hooks see).
- `Role`: what a rank does at this step, decided in `decided` (the settle vote included):
  every rank drains, it stays in the new group (ahead: it forms the new group while the
  checkpoint of the agreed step commits through the old formation's store), it leaves, it joins a running group (in
  `resume()`), the membership asked nothing (settled), or its walk failed (only the departure is
  left). `Role.outcome` is where a completed walk ends, `Role.failed` where a failed one does.
- `Outcome`: continue ("in-place": training goes on in the new group), settled, leave, fallback,
  drain. Every outcome but continue and settled ends in the departure.
- `Saved`: the checkpoint the step wrote; `exit_code` is the only place 83 (durable) or 84 (not)
  is derived.
- `StepRecord`: one agreed step as this rank saw it. It replaces the two records of before:
  `DrainRecord` and `ResizeRecord` are its names too, and it answers their fields
  (`saved_step`, `ok`, `exit_code`, `steps_lost`, `checkpoint_seconds`, `used_snapshot`,
  `hooks_started_at`; `durable`, `drain`, `pause_seconds`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from spotguard.wire.notice import Notice


class Phase(enum.Enum):
    AGREED = "agreed"  # every rank holds the agreed notice (or membership)
    DECIDED = "decided"  # drain, settle or resize: rank 0's word on a membership's staleness
    CHECKPOINTED = "checkpointed"  # the agreed step copied, its durable write running behind
    HANDOVER = "handover"  # the state this rank holds for the new group, beside the write
    DURABLE = "durable"  # the write committed by every rank, the @on_reclaim hooks, the vote
    LEFT = "left"  # the old groups gone (no last agreement: the vote was the last collective)
    FORMED = "formed"  # the new default group and its control groups
    REBUILT = "rebuilt"  # the adapter's model for the new group, the Guard's agreement on it
    TRANSFERRED = "transferred"  # the state received from a live peer and loaded
    COMMITTED = "committed"  # every rank of the new group voted yes
    DEPARTED = "departed"  # termination message, @on_drain hooks, then exit (or the loop)


CHANGE_PHASES = ("checkpointed", "handover", "durable", "left", "formed", "rebuilt", "transferred", "committed")
PHASES = CHANGE_PHASES  # the name the benches and the timelines know


class Outcome(enum.Enum):
    CONTINUE = "in-place"  # this rank trains on in the new group
    SETTLED = "settled"  # an agreed membership asked nothing: training goes on in the same group
    LEAVE = "leave"  # this rank's host left the group: it exits 83 (84 when the checkpoint failed)
    FALLBACK = "fallback"  # the change failed: this rank exits with the durable checkpoint (83, or 84)
    DRAIN = "drain"  # every rank checkpoints the step and exits 83 (84)


class Role(enum.Enum):
    UNDECIDED = "not decided yet"
    DRAINING = "every rank drains"
    STAYING = "stays in the new group"
    STAYING_AHEAD = "stays in the new group, formed while its checkpoint commits"
    LEAVING = "leaves the group"
    JOINING = "joins a running group"
    SETTLED = "nothing to change"
    FAILED = "its walk failed: it departs"

    @property
    def outcome(self) -> Outcome:
        """Where a walk of this role ends when every phase succeeded."""
        return _SUCCESS[self]

    @property
    def failed(self) -> Outcome:
        """Where a walk of this role ends when a phase failed (a joiner raises instead)."""
        return _FAILURE[self]


_SUCCESS = {Role.UNDECIDED: Outcome.DRAIN, Role.DRAINING: Outcome.DRAIN, Role.STAYING: Outcome.CONTINUE,
            Role.STAYING_AHEAD: Outcome.CONTINUE,
            Role.LEAVING: Outcome.LEAVE, Role.JOINING: Outcome.CONTINUE, Role.SETTLED: Outcome.SETTLED,
            Role.FAILED: Outcome.FALLBACK}
_FAILURE = {Role.UNDECIDED: Outcome.DRAIN, Role.DRAINING: Outcome.DRAIN, Role.STAYING: Outcome.FALLBACK,
            Role.STAYING_AHEAD: Outcome.FALLBACK,
            Role.LEAVING: Outcome.LEAVE, Role.JOINING: Outcome.FALLBACK, Role.SETTLED: Outcome.DRAIN,
            Role.FAILED: Outcome.FALLBACK}


@dataclass(frozen=True)
class Saved:
    """The checkpoint an agreed step wrote (see the module docstring)."""

    step: int  # the step it holds (older than the agreed step when the snapshot was persisted)
    durable: bool  # committed by every rank
    used_snapshot: bool = False
    seconds: float = 0.0  # from the start of the save to its outcome
    started_at: float = 0.0  # time.time() when the save started
    for_notice: bool = True  # a notice's checkpoint (reported to the sidecar), not a grow's own save
    tier: str | None = None  # where it is durable, for a store with tiers ("local", "object", ...)

    @property
    def exit_code(self) -> int:
        """83 when durable, 84 when not: the only place either is derived."""
        return EXIT_PREEMPTED if self.durable else EXIT_CHECKPOINT_FAILED


@dataclass
class StepRecord:
    """One agreed step as this rank saw it (see the module docstring)."""

    step: int  # the last step completed before the agreement
    notice: Notice | None  # the agreed notice (a membership's record of it); None for a joiner
    reason: str  # "membership" or the notice's kind
    old_world_size: int
    new_world_size: int
    old_rank: int
    new_rank: int | None  # None when this rank left (or drained)
    outcome: Outcome = Outcome.CONTINUE
    started_at: float = 0.0  # time.time() when the walk began (after the agreement)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds since started_at
    error: str = ""
    joiners: int = 0
    saved: Saved | None = None
    drain_seconds: float = 0.0  # the @on_drain hooks

    # ---- the drain's view ------------------------------------------------------------------------
    @property
    def saved_step(self) -> int:
        return self.saved.step if self.saved is not None else self.step

    @property
    def steps_lost(self) -> int:
        return self.step - self.saved_step

    @property
    def ok(self) -> bool:
        return self.saved is not None and self.saved.durable

    @property
    def exit_code(self) -> int:
        return (self.saved or Saved(self.step, False)).exit_code

    @property
    def used_snapshot(self) -> bool:
        return self.saved is not None and self.saved.used_snapshot

    @property
    def checkpoint_seconds(self) -> float:
        return self.saved.seconds if self.saved is not None else 0.0

    @property
    def hooks_started_at(self) -> float:
        """time.time() when this rank started the checkpoint (the walk's start without one)."""
        return self.saved.started_at if self.saved is not None else self.started_at

    # ---- the change's view ---------------------------------------------------------------------
    @property
    def durable(self) -> bool:
        """A durable checkpoint of the agreed step exists (written beside the hand-over)."""
        return self.ok

    @property
    def drain(self) -> StepRecord | None:
        """The checkpoint this step wrote (this record), or None when it wrote none."""
        return self if self.saved is not None else None

    @property
    def pause_seconds(self) -> float:
        return max((s for p, s in self.phases.items() if p != Phase.DEPARTED.value), default=0.0)


DrainRecord = StepRecord  # the names of before, for code that imports them
ResizeRecord = StepRecord
