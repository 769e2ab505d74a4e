"""The agreed-step machine: the one owner of everything that happens at an agreed step, a drain
included. The Guard hands it the verdict of its agreement and a narrow `Effects`; it walks
`table.TABLE`, settles every error at one point, and hands a leaving rank to its departure.

Contract:
- `AgreedStepMachine(session, effects, view, departure, table=TABLE)`; `learn()` (collective, once the Guard
  exists): the group's hosts, and a joiner's or start-at-min worker's first generation.
- `run(step, verdict)` (every rank of the group, at the agreed step): one walk; returns the
  `StepResult` (continued for a settled membership, resized with the record, or drained with
  `ReturnToLoop`; `ExitProcess` exits in the departure). `join()` (a joiner, in `resume()`): the
  joiner's walk; the step to start from; raises on a failure.
- Timeouts (the session's `Timeouts`): a walk has a deadline, its start + `change` (a drain: +
  `durable`); every row's waits on a peer are bounded by `reform` (a drain's by `durable`), never
  past the deadline (`GroupSession.bounded`, released in the walk's one `finally`); a change's
  checkpoint write is waited for one re-form timeout beyond a save's estimate (`table`,
  `durable`); a rank that reaches a row after the deadline (it was stopped) departs at once.
- Errors: an action that raises ends the walk where its row says. `End.DEPART`: the record's
  outcome becomes the role's failed one, the checkpoint in flight is waited for (`abandon`:
  never a collective), the groups are left (this rank never votes yes again: a peer waiting on
  it fails at once instead of waiting for the timeout once more), and the departure runs. A
  failure before anything was saved departs with 84.
- Records: `resizes` (every in-place change, in order), `last_drain` (the newest record with a
  notice's checkpoint, or that departed). After a change that continues, the view learns it and
  the `@on_resize` hooks run (`hook(record)`); `@on_resize_phase` hooks (`hook(phase, record)`)
  run as each phase of a change is reached, inside it (one that raises fails the phase).
"""
from __future__ import annotations

import logging
import time

from spotguard.hooks.agreement.base import Verdict
from spotguard.hooks.elastic.membership_view import MembershipView
from spotguard.hooks.group_session import GroupSession
from spotguard.hooks.machine.departure import Departure
from spotguard.hooks.machine.effects import Effects
from spotguard.hooks.machine.model import CHANGE_PHASES, Outcome, Phase, Role, StepRecord
from spotguard.hooks.machine.table import TABLE, End, Row, Walk
from spotguard.hooks.step_result import CONTINUED, Happened, StepResult

log = logging.getLogger("spotguard.hooks.elastic")

CHANGE_ROLES = frozenset({Role.STAYING, Role.STAYING_AHEAD, Role.LEAVING, Role.JOINING})


class ChangeExpired(RuntimeError):
    """This rank reached a phase after its walk's deadline: its peers have given up on it."""


class AgreedStepMachine:
    """See the module docstring."""

    def __init__(self, session: GroupSession, effects: Effects, view: MembershipView | None, departure: Departure,
                 table: tuple[Row, ...] = TABLE):
        self.session, self.effects, self.view, self.departure = session, effects, view, departure
        self.table = table
        self.resizes: list[StepRecord] = []
        self.last_drain: StepRecord | None = None

    def learn(self) -> None:
        """See the module docstring."""
        if self.view is None:
            return
        self.view.learn_hosts(self.effects.collectives())
        first = self.session.first_generation()
        if first is not None:
            self.view.adopt(first)

    # ---- the two walks ------------------------------------------------------------------------
    def run(self, step: int, verdict: Verdict) -> StepResult:
        """See the module docstring."""
        collectives = self.effects.collectives()
        world, rank = collectives.world_size, collectives.rank
        walk = self._walk_for(StepRecord(step, None, "", world, world, rank, None, started_at=time.time()))
        walk.verdict = verdict
        self._walk(walk)
        return self._result(walk)

    def join(self) -> int:
        """See the module docstring."""
        collectives = self.effects.collectives()
        record = StepRecord(-1, None, "membership", 0, collectives.world_size, -1, collectives.rank,
                            started_at=time.time())
        walk = self._walk_for(record, Role.JOINING)
        self._walk(walk)
        assert walk.held is not None
        record.step = walk.held.step
        self.session.state_received = True
        log.warning("joined in place: state of step %d from a live peer, now rank %d of %d", record.step,
                    collectives.rank, collectives.world_size)
        return record.step + 1

    def _walk_for(self, record: StepRecord, role: Role = Role.UNDECIDED) -> Walk:
        timeouts = self.session.timeouts
        return Walk(record.step, record, self.session, self.effects, self.view, self.departure,
                    time.monotonic() + timeouts.change, role=role)

    def _walk(self, walk: Walk) -> None:
        with self.session.bounded(self.session.timeouts.reform):  # released in this one `finally`
            for row in self.table:
                if walk.role in row.who:
                    self._run(walk, row)

    def _run(self, walk: Walk, row: Row) -> None:
        try:
            if row.phase is Phase.DEPARTED:
                self.last_drain = walk.record
            else:
                self._enter(walk, row)
            row.action(walk)
            self._reached(walk, row.phase)
        except Exception as exc:
            if row.on_error is End.RAISE or walk.role is Role.JOINING:
                self._abandon(walk, row, exc)
                raise
            self._fail(walk, row, exc)

    def _enter(self, walk: Walk, row: Row) -> None:
        """The deadline, and this row's bounds: on every wait on a peer, on its own waits."""
        timeouts, now = self.session.timeouts, time.monotonic()
        if walk.role is Role.DRAINING and row.phase is Phase.CHECKPOINTED:  # a drain waits on writes
            walk.deadline = max(walk.deadline, now + timeouts.durable)
        left = walk.deadline - now
        if left <= 0:
            raise ChangeExpired(f"reached {row.phase.value} {-left:.1f}s after this step's deadline (this rank was "
                                "stopped or too slow): its peers have given up")
        peer = timeouts.durable if walk.role is Role.DRAINING else timeouts.reform
        walk.limit, walk.peer_limit = left, min(peer, left)
        self.session.bound(walk.peer_limit)

    def _reached(self, walk: Walk, phase: Phase) -> None:
        record = walk.record
        record.phases[phase.value] = time.time() - record.started_at
        if phase is Phase.DECIDED and walk.role in CHANGE_ROLES:
            self.resizes.append(record)
        if phase is Phase.DURABLE and record.saved is not None and record.saved.for_notice:
            self.last_drain = record
        if phase.value in CHANGE_PHASES and walk.role in CHANGE_ROLES:
            for hook in self.effects.hooks.phase:
                hook(phase.value, record)

    # ---- the one place errors are settled ------------------------------------------------------------
    def _fail(self, walk: Walk, row: Row, exc: Exception) -> None:
        record = self._abandon(walk, row, exc)
        record.outcome = walk.role.failed
        walk.role = Role.FAILED
        log.error("agreed step %d failed at %s (%s): %s, with the checkpoint of step %d %s", record.step,
                  row.phase.value, record.error, record.outcome.value, record.saved_step,
                  "durable" if record.ok else "NOT durable")

    def _abandon(self, walk: Walk, row: Row, exc: Exception) -> StepRecord:
        """The error recorded, the write in flight waited for (no collective), the groups left."""
        record = walk.record
        record.error = f"{type(exc).__name__}: {exc}"
        record.phases["fallback"] = time.time() - record.started_at  # the stall before the fallback
        if walk.checkpoint is not None:
            record.saved = walk.checkpoint.abandon(max(walk.deadline - time.monotonic(), 0.0))
        self.session.leave()  # never a yes vote from here on: peers waiting in a collective fail too
        return record

    # ---- after the walk ---------------------------------------------------------------------------------
    def _result(self, walk: Walk) -> StepResult:
        record = walk.record
        if record.outcome is Outcome.SETTLED:
            return CONTINUED
        if record.outcome is not Outcome.CONTINUE:  # it departed (ReturnToLoop: training code decides)
            return StepResult(Happened.DRAINED, drain=record)
        if self.view is not None:
            self.view.after_change(walk.resize().change.plan, record.started_at)
        log.warning("in place at step %d: world %d -> %d, rank %d -> %s, paused %.3fs", record.step,
                    record.old_world_size, record.new_world_size, record.old_rank, record.new_rank,
                    record.pause_seconds)
        for hook in self.effects.hooks.resize:
            hook(record)
        return StepResult(Happened.RESIZED, record, record.drain)
