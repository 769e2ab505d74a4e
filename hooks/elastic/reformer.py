"""The change itself: at the agreed step, survivors re-form the group in the same processes.

`Reformer.run(seam, step, change, checkpointed)` on every rank of the old group, in this order
(each phase reported to `on_phase(name, record)`, for the trainer's timeline and for tests):
1. `handover` (old group): `adapter.full_state()` (FSDP2: the shards of every rank, leaving ranks
   included, gathered onto every rank) and, when the new leader is a survivor, the address of
   its store broadcast from it. A leaving rank is done: it returns `Outcome.LEAVE` (the Guard
   then exits 83; its checkpoint of this step is durable, see below).
2. `left`: the old process groups are destroyed (after a last agreement, so no rank tears down a
   connection a peer still uses).
3. `formed`: the new default group at the change's prefix on the leader's store (`Rendezvous`).
4. `rebuilt`: `adapter.rebuild()` (the user's `build`: model, then optimizer), then the Guard's
   own group, agreement and host list (`seam.bind_group()`), in the order a joiner makes them.
5. `transferred`: when anybody joins, the held state is broadcast from the lowest survivor
   (`transfer.share`) and every rank loads it; with nobody joining each survivor loads its own.
6. `committed`: one `all_ok` over the new group (a rank whose load or `transferred` hook failed
   votes no there). Returns `Outcome.CONTINUE`.
Steps 5 and 6 are `take_state`, the one function a joiner runs too (`Guard.resume`), so both
sides of a change make the same collectives in the same order by construction.
Every collective from step 1 to the commit, and every group made meanwhile, waits at most the
re-form timeout (`bound`): a peer that dies at any point costs at most that long, then the
fallback. The commit gives training torch's default timeout back.
Every change writes the durable checkpoint of the agreed step BEFORE step 1 (`checkpointed`:
a shrink through the Guard's drain sequence, as without in-place, a grow with the survivors' own
save), so the notice path is never less safe and a fallback needs no group of its own: after a
survivor's death no group of the survivors could form, and once shards move peer to peer no
survivor holds what a dead one held. Any exception in steps 1-6 (a timeout re-forming, a peer,
survivor or joiner, dying at any point) takes the fallback: every survivor returns
`Outcome.FALLBACK` and exits 83 like a drained rank, so the launcher or the supervisor relaunches
from that checkpoint (84 when it was not durable: the job resumes from the previous one).
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.bound import bound_groups, release_groups
from spotguard.hooks.elastic.membership_view import Change
from spotguard.hooks.elastic.rendezvous import Rendezvous
from spotguard.hooks.elastic.transfer import HeldState, hand_over, load, receive

log = logging.getLogger("spotguard.hooks.elastic")

PHASES = ("handover", "left", "formed", "rebuilt", "transferred", "committed")  # "fallback" ends a failed one


class Outcome(enum.Enum):
    CONTINUE = "in-place"  # this rank trains on in the new group
    LEAVE = "leave"  # this rank's host left: it exits 83
    FALLBACK = "fallback"  # the in-place path failed: durable checkpoint, exit (83, or 84 if it failed)


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
    durable: bool = False  # a durable checkpoint of `step` exists (a shrink's, or the fallback's)
    joiners: int = 0

    @property
    def pause_seconds(self) -> float:
        return max(self.phases.values(), default=0.0)


class Seam(Protocol):
    """What the reformer needs from the Guard."""

    collectives: Collectives
    adapter: Any

    def leave_group(self) -> None: ...

    def bind_group(self) -> None: ...


class Reformer:
    """See the module docstring."""

    def __init__(self, rendezvous: Rendezvous, on_phase: Callable[[str, ResizeRecord], None] | None = None):
        self.rendezvous = rendezvous
        self.on_phase = on_phase

    def _mark(self, record: ResizeRecord, phase: str) -> None:
        record.phases[phase] = time.time() - record.started_at
        if self.on_phase is not None:
            self.on_phase(phase, record)

    def run(self, seam: Seam, step: int, change: Change, checkpointed: bool) -> ResizeRecord:
        plan = change.plan
        old_rank = seam.collectives.rank
        record = ResizeRecord(step, change.reason, plan.old_world_size, plan.new_world_size, old_rank,
                              plan.new_rank(old_rank), started_at=time.time(), durable=checkpointed,
                              joiners=len(plan.joining_hosts) * plan.procs_per_host)
        adapter = seam.adapter
        bound_groups(self.rendezvous.timeout)
        try:
            extra = adapter.extra_state() if getattr(adapter, "extra_state", None) else {}
            held = hand_over(seam.collectives, adapter, step, extra, plan)
            # The first survivor (in target order) serves the new group's store unless its leader
            # is a joiner (whose store the membership names).
            first = plan.first_survivor_old_rank
            mine = self.rendezvous.address.encode() if old_rank == first else b""
            survivor_store = seam.collectives.broadcast_bytes(mine, first).decode()
            if old_rank == first:
                self.rendezvous.serve()
            store = survivor_store if plan.leader_old_rank is not None else change.store
            self._mark(record, "handover")
            seam.leave_group()
            self._mark(record, "left")
        except Exception as exc:  # the old group broke: nobody continues in place
            return self._fall_back(seam, record, exc)
        if record.new_rank is None:
            record.outcome = Outcome.LEAVE
            return record
        try:
            self.rendezvous.form(store, change.prefix, record.new_rank, plan.new_world_size)
            self._mark(record, "formed")
            adapter.rebuild()
            seam.bind_group()
            self._mark(record, "rebuilt")
            take_state(seam.collectives, adapter, held, share_first=record.joiners > 0,
                       loaded=lambda: self._mark(record, "transferred"))
        except Exception as exc:  # any failure in place: today's path
            return self._fall_back(seam, record, exc)
        self._mark(record, "committed")
        return record

    def _fall_back(self, seam: Seam, record: ResizeRecord, exc: Exception) -> ResizeRecord:
        record.error = f"{type(exc).__name__}: {exc}"
        record.outcome = Outcome.FALLBACK if record.new_rank is not None else Outcome.LEAVE
        record.phases["fallback"] = time.time() - record.started_at  # the stall before the fallback
        seam.collectives.abandon()  # never a yes vote from here on: peers waiting in a collective fail too
        release_groups()
        log.error("in-place change at step %d failed (%s): exit with the checkpoint of step %d %s, relaunch",
                  record.step, record.error, record.step, "durable" if record.durable else "NOT durable")
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
