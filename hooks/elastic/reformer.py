"""The change itself, as one state machine: every phase of an in-place change, for the ranks of
the old group (leaving and staying) and for a joiner, with the fallback, in one table.

    agreed -> checkpointed -> handover -> durable -> left -> formed -> rebuilt -> transferred -> committed
                   |              |           |          `-> (a leaving rank: LEAVE, exit 83)
                   `-> DRAIN      `-> FALLBACK (any failure from `handover` on, once the write
                                         ended: exit 83, or 84 when it was not durable)

`TABLE` says, for each phase, what runs to reach it, who runs it (`OLD`: every rank of the old
group, `STAYING`: the ranks of the new group that were in the old one, `NEW`: every rank of the
new group, joiners included) and where a failure ends. `Reformer.run(seam, step, notice, change)`
walks it on every rank of the old group; `Reformer.join(seam)` walks the joiner's rows (its group
was formed by `join.init_process_group`, its model built by the user's code). Each phase reached
is reported to `on_phase(name, record)` (timelines, tests); a failure records `fallback`.

What each phase does:
- `checkpointed` (old group): the state of the agreed step copied into the snapshot engine's
  host buffers (the save decision and the copy: a shrink through the Guard's drain sequence, a
  grow with the survivors' own save) and its durable write started behind, on the adapter's
  checkpoint group of the old formation. Nothing has moved yet.
- `durable` (old group): waits for that write: durable and committed by every rank (the store's
  commit protocol), then the drain sequence's rest (the @on_reclaim hooks, the vote; a leaving
  rank's reports and termination message). It is the last phase on the old groups, so the write
  overlaps the hand-over, and a leaving rank never leaves before its part is committed. So the
  notice path is never less safe, and a fallback needs no group of its own (after a survivor's
  death no group of the survivors could form). A shrink whose checkpoint failed ends in
  FALLBACK on every rank alike (the vote), exit 84; a grow's failed save goes on, not durable.
  Why the write cannot run past `left`: its commit protocol and DCP's collectives run on the old
  formation's checkpoint group, which leaving the old groups destroys (torch has one default
  group at a time), and only the old group holds every part of the agreed step (a leaving
  rank's part goes with it): a write moved after `committed` would widen the window in which a
  survivor's death loses the step from the write's duration to the whole change's.
- `handover` (old group): the state this rank holds for the new group (`transfer.hand_over`: the
  reshard plan voted on, leaving ranks' rows sent to survivors; or the full state on the gather path)
  and, when the new leader is a survivor, its store's address broadcast from it.
- `left` (old group): the old groups are left after a last agreement. A leaving rank ends: LEAVE.
- `formed`: the new default group at the change's prefix on the leader's store (`Rendezvous`).
- `rebuilt`: `adapter.rebuild()` (the user's `build`), then the Guard's group (`seam.bind_group()`),
  in the order a joiner makes them.
- `transferred`, `committed`: `take_state`, the one function both sides run, so survivors and
  joiners make the same collectives in the same order by construction: the state from a live
  peer when anybody joins, every rank loads, one `all_ok` vote over the new group (a rank whose
  load or `transferred` hook failed votes no). On success the groups get torch's default
  timeout back.
Every collective from `handover` to the commit waits at most the re-form timeout (`bound`), the
write's own on the checkpoint group included: a peer that dies at any point costs at most that
long. On FALLBACK a rank first waits for the write in flight (no collective of its own: the
write's commit protocol decides, on every rank alike, whether it is durable), then abandons its
groups (never a yes vote from there on) and exits 83 with the durable checkpoint (84 when it was
not durable), so the launcher or the supervisor relaunches from it.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.drain import PendingCheckpoint
from spotguard.hooks.elastic.bound import bound_groups, release_groups
from spotguard.hooks.elastic.membership_view import Change
from spotguard.hooks.elastic.rendezvous import Rendezvous
from spotguard.hooks.elastic.transfer import HeldState, hand_over, load, receive

log = logging.getLogger("spotguard.hooks.elastic")

# The phases in order ("fallback" ends a failed change).
PHASES = ("checkpointed", "handover", "durable", "left", "formed", "rebuilt", "transferred", "committed")


class Outcome(enum.Enum):
    CONTINUE = "in-place"  # this rank trains on in the new group
    LEAVE = "leave"  # this rank's host left: it exits 83 (84 when the checkpoint failed)
    FALLBACK = "fallback"  # the in-place path failed: durable checkpoint, exit (83, or 84 if it failed)


class Who(enum.Enum):
    OLD = "every rank of the old group"
    STAYING = "the old group's ranks that stay"
    NEW = "every rank of the new group, joiners included"


class End(enum.Enum):
    DRAIN = "every rank leaves with the checkpoint's exit code"
    FALLBACK = "the write waited for, then survivors exit 83 (84: not durable); a leaving rank leaves"
    RAISE = "the joiner raises (it holds nothing to fall back to)"


@dataclass(frozen=True)
class Row:
    phase: str  # reached when `action` returns
    action: str  # the Reformer method that runs to reach it
    who: Who
    on_error: End  # where an exception in `action` (a survivor's) ends
    joiner: bool  # whether a joiner runs it too (the rows before `transferred` are its own start)


TABLE: tuple[Row, ...] = (
    #   phase          action            who          failure        joiner
    Row("checkpointed", "_checkpoint", Who.OLD, End.DRAIN, False),
    Row("handover", "_hand_over", Who.OLD, End.FALLBACK, False),  # while the write runs behind
    Row("durable", "_await_durable", Who.OLD, End.FALLBACK, False),
    Row("left", "_leave_old_group", Who.OLD, End.FALLBACK, False),  # then a leaving rank: LEAVE
    Row("formed", "_form", Who.STAYING, End.FALLBACK, False),
    Row("rebuilt", "_rebuild", Who.STAYING, End.FALLBACK, False),
    Row("transferred", "_transfer", Who.NEW, End.FALLBACK, True),  # its `loaded` callback marks it
    Row("committed", "_commit", Who.NEW, End.FALLBACK, True),
)


class NotDurable(RuntimeError):
    """A shrink's checkpoint failed on some rank (every rank learns it in the vote): nobody
    leaves the old group for the new one, every rank falls back with exit 84."""


@dataclass
class ResizeRecord:
    """One change as this rank saw it."""

    step: int  # the last step completed before the change
    reason: str  # "membership" or the notice kind that shrank the group
    old_world_size: int
    new_world_size: int
    old_rank: int
    new_rank: int | None  # None when this rank left
    outcome: Outcome = Outcome.CONTINUE
    started_at: float = 0.0  # time.time() when the change began (after the agreement)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds since started_at
    error: str = ""
    durable: bool = False  # a durable checkpoint of `step` exists (written beside the hand-over)
    joiners: int = 0
    drain: Any = None  # the checkpoint's DrainRecord, from `durable` (the Guard's departure reads it)

    @property
    def pause_seconds(self) -> float:
        return max(self.phases.values(), default=0.0)


class Seam(Protocol):
    """What the reformer needs from the Guard."""

    collectives: Collectives
    adapter: Any

    def start_checkpoint(self, step: int, notice: Any, *, staying: bool, grow: bool) -> PendingCheckpoint:
        """The checkpoint of `step` started (collective over the old group): the copy taken, the
        write running behind; its `finish()` (collective) waits for it and returns a DrainRecord."""

    def leave_group(self) -> None: ...

    def bind_group(self) -> None: ...


@dataclass
class _Run:
    """What one walk of the table carries from phase to phase."""

    seam: Seam
    record: ResizeRecord
    change: Change | None = None
    notice: Any = None
    held: HeldState | None = None
    store: str = ""
    pending: PendingCheckpoint | None = None  # the checkpoint whose write runs behind, until `durable`


class Reformer:
    """See the module docstring. `transfer` replaces `take_state` (the table tests script it with
    the collectives and the rendezvous)."""

    def __init__(self, rendezvous: Rendezvous, on_phase: Callable[[str, ResizeRecord], None] | None = None,
                 transfer: Callable[..., HeldState] | None = None):
        self.rendezvous = rendezvous
        self.on_phase = on_phase
        self.take_state = transfer if transfer is not None else take_state

    # ---- the two walks -----------------------------------------------------------------------
    def run(self, seam: Seam, step: int, notice: Any, change: Change) -> ResizeRecord:
        """A rank of the old group: every row; ends CONTINUE, LEAVE or FALLBACK."""
        plan = change.plan
        old_rank = seam.collectives.rank
        record = ResizeRecord(step, change.reason, plan.old_world_size, plan.new_world_size, old_rank,
                              plan.new_rank(old_rank), started_at=time.time(),
                              joiners=len(plan.joining_hosts) * plan.procs_per_host)
        run = _Run(seam, record, change, notice)
        for row in TABLE:
            if row.who is not Who.OLD and record.new_rank is None:
                record.outcome = Outcome.LEAVE
                release_groups()  # a rank that returns to the loop (exit_on_drain=False) is unbounded
                return record
            try:
                getattr(self, row.action)(run)
                self._mark(record, row.phase)  # a phase hook that raises fails the phase too
            except Exception as exc:
                return self._fail(run, row, exc)
        return record

    def join(self, seam: Seam, step: int = -1) -> ResizeRecord:
        """A joiner, in `resume()`: the rows it shares with the survivors; raises on a failure."""
        world, rank = seam.collectives.world_size, seam.collectives.rank
        record = ResizeRecord(step, "membership", 0, world, -1, rank, started_at=time.time())
        run = _Run(seam, record)
        for row in TABLE:
            if row.joiner:
                try:
                    getattr(self, row.action)(run)
                    self._mark(record, row.phase)
                except Exception as exc:
                    self._fail(run, row, exc)
                    raise
        assert run.held is not None
        record.step = run.held.step
        return record

    # ---- the actions (each raises on failure) -----------------------------------------------------
    def _checkpoint(self, run: _Run) -> None:
        assert run.change is not None
        grow = not run.change.plan.leaving_hosts
        run.pending = run.seam.start_checkpoint(run.record.step, run.notice,
                                                staying=run.record.new_rank is not None, grow=grow)
        bound_groups(self.rendezvous.timeout)

    def _await_durable(self, run: _Run) -> None:
        assert run.change is not None and run.pending is not None
        drained = run.pending.finish()
        run.record.drain, run.record.durable = drained, bool(drained.ok)
        if not drained.ok and run.change.plan.leaving_hosts:
            raise NotDurable(f"the checkpoint of step {run.record.step} failed: every rank falls back")

    def _hand_over(self, run: _Run) -> None:
        assert run.change is not None
        seam, plan, step = run.seam, run.change.plan, run.record.step
        adapter = seam.adapter
        extra = adapter.extra_state_now()
        run.held = hand_over(seam.collectives, adapter, step, extra, plan)
        # The first survivor (in target order) serves the new group's store unless its leader
        # is a joiner (whose store the membership names).
        first, old_rank = plan.first_survivor_old_rank, run.record.old_rank
        mine = self.rendezvous.address.encode() if old_rank == first else b""
        survivor_store = seam.collectives.broadcast_bytes(mine, first).decode()
        if old_rank == first:
            self.rendezvous.serve()
        run.store = survivor_store if plan.leader_old_rank is not None else run.change.store

    def _leave_old_group(self, run: _Run) -> None:
        run.seam.leave_group()

    def _form(self, run: _Run) -> None:
        assert run.change is not None and run.record.new_rank is not None
        self.rendezvous.form(run.store, run.change.prefix, run.record.new_rank, run.change.plan.new_world_size)

    def _rebuild(self, run: _Run) -> None:
        run.seam.adapter.rebuild()
        run.seam.bind_group()

    def _transfer(self, run: _Run) -> None:
        joiner = run.held is None
        run.held = self.take_state(run.seam.collectives, run.seam.adapter, run.held,
                                   share_first=joiner or run.record.joiners > 0,
                                   loaded=lambda: self._mark(run.record, "transferred"))
        if joiner:
            run.record.durable = True  # the survivors' checkpoint of this step

    def _commit(self, run: _Run) -> None:
        """The vote ran at the end of `take_state`; committing is releasing the bound."""
        release_groups()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _mark(self, record: ResizeRecord, phase: str) -> None:
        if phase in record.phases:  # `transferred` is marked by take_state's `loaded` already
            return
        record.phases[phase] = time.time() - record.started_at
        if self.on_phase is not None:
            self.on_phase(phase, record)

    def _fail(self, run: _Run, row: Row, exc: Exception) -> ResizeRecord:
        record = run.record
        record.error = f"{type(exc).__name__}: {exc}"
        record.phases["fallback"] = time.time() - record.started_at  # the stall before the fallback
        if run.pending is not None and record.drain is None:  # the write in flight: durable first
            record.drain = run.pending.without_vote()
            record.durable = bool(record.drain.ok)
        if row.on_error is End.DRAIN:
            record.outcome = Outcome.FALLBACK if record.new_rank is not None else Outcome.LEAVE
            log.error("in-place change at step %d not started (%s): every rank drains", record.step, record.error)
            return record
        record.outcome = Outcome.FALLBACK if record.new_rank is not None else Outcome.LEAVE
        run.seam.collectives.abandon()  # never a yes vote from here on: peers waiting in a collective fail too
        release_groups()
        if row.on_error is End.FALLBACK:
            log.error("in-place change at step %d failed at %s (%s): exit with the checkpoint of step %d %s, "
                      "relaunch", record.step, row.phase, record.error, record.step,
                      "durable" if record.durable else "NOT durable")
        return record


def take_state(collectives: Collectives, adapter: Any, held: HeldState | None, *, share_first: bool,
               loaded: Callable[[], None] | None = None) -> HeldState:
    """The end of a change on every rank of the new group, survivors and joiners alike: when
    anybody joined, the held state from the lowest rank holding it (`share`; a joiner passes
    None); this rank loads it (a joiner takes the source's extras too), `loaded()` runs, and the
    commit vote. A failure here votes no, so every rank learns it in the vote; raises on every
    rank when any rank failed. On success the groups get torch's default timeout back."""
    joiner = held is None
    held = receive(collectives, adapter, held, share_first=share_first)
    try:
        load(adapter, held)
        if joiner:
            adapter.extra = dict(held.extra)
        if loaded is not None:
            loaded()
    except Exception:
        collectives.all_ok(False)
        raise
    if not collectives.all_ok(True):
        raise RuntimeError("a rank of the new group failed the change")
    release_groups()
    return held
