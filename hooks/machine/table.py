"""The agreed-step machine's table: every phase of an agreed step, what runs to reach it, and who
runs it, for every walk (a drain, either side of an in-place change, a joiner), in one place.

    agreed -> decided -> checkpointed -> [handover] -> durable -> [left -> formed -> rebuilt ->
    transferred -> committed] -> departed
    a staying rank ahead: ... handover -> left -> formed -> rebuilt -> transferred -> durable -> committed

`TABLE` rows: (phase, action, who, on_error). `who` is the set of roles that run the row (the
role is taken in `decided`): a drain walks checkpointed -> durable -> departed; a leaving rank
checkpointed -> handover -> durable -> left -> departed; a staying rank every row of the change
and no departure, `durable` after `transferred` when it is ahead (`Role.STAYING_AHEAD`: the
adapter `writes_over_channel` and the session is in place, so the change's checkpoint coordinates
through a `StoreChannel` on the old formation's store, not the old groups, and commits while the
survivors leave, form, rebuild and receive: the pause is paced by the transfer, not the write);
a joiner (in `resume()`) transferred -> committed; a settled membership stops
after `decided`. `on_error`: `End.DEPART` (the rank's failed outcome, `Role.failed`: fallback,
leave or drain, then the departure, the one row a failed walk still runs) or `End.RAISE` (the
agreement's own broadcast: as any training collective; a joiner's rows raise too, it holds
nothing to fall back to). The executor (`machine.executor`) walks the rows; each action takes the
`Walk` (what one walk carries from phase to phase) and raises on failure.

What each phase does:
- `agreed`: the notice `verdict.source_rank` holds (or the pushed membership's holder) is
  broadcast, with the agreed (earliest) deadline: every rank acts on the same notice.
- `decided`: `decide.decide` (pure); for a pushed membership rank 0's word on whether it
  settles holds on every rank (the stale rule reads this rank's clock): the settle vote. A
  settled membership's generation is adopted; a membership change's generation too.
- `checkpointed` (old group): `checkpoint.Checkpoint.start`: the state of the agreed step copied,
  its durable write behind, on the old formation's checkpoint group. Nothing has moved yet.
- `handover` (old group, a change): the state this rank holds for the new group
  (`transfer.hand_over`: the reshard plan voted on, leaving ranks' rows sent to survivors), and,
  when the new leader is a survivor, its store's address broadcast from it. It overlaps the write.
- `durable` (old group): `Checkpoint.finish`: the write committed by every rank, the
  @on_reclaim hooks, the vote. In a change the write is waited for at most one re-form timeout
  beyond the adapter's estimate of a save: a write held by a stopped peer (its commit protocol
  waits on it once per collective) counts as failed then. It is the last collective on the old
  groups, so a leaving rank never leaves before its part is committed. A change in which someone
  leaves does not go on without a durable checkpoint (`Resize.requires_durable`): every rank
  departs, 84; a grow goes on, not durable. A write on the old groups cannot run past `left`:
  its commit protocol runs on the old formation's checkpoint group, the only one that holds
  every part of the agreed step. Ahead (a shrink only: a grow's checkpoint is its fallback),
  the write and its commit run through the channel instead and the @on_reclaim hooks and their
  vote run in `checkpointed`, on the old group: a leaving rank still reaches `durable` before it
  departs (and lingers until every rank read the outcome: it may serve the store), a staying
  rank reaches it after `transferred`, so a shrink still learns the checkpoint is durable before
  anyone leaves for good and before the new group commits; a change whose checkpoint failed
  departs, 84, as before. The price: a peer that dies before its part is committed now costs
  the checkpoint while the new group forms too, not only while the old one waits for it.
- `left` (a change): the old groups are gone (`GroupSession.leave`, no last agreement).
- `formed` (staying): the new default group at the change's prefix (`GroupSession.reform`) on the
  first survivor's store, or on the store the membership names when its leader is a joiner.
- `rebuilt` (staying): `adapter.rebuild()` (the user's `build`), the Guard's collectives and
  agreement on the new group (`Effects.rejoin`), its hosts: the order a joiner makes them in.
- `transferred` (new group): the state from a live peer when anybody joins (`transfer.receive`),
  loaded by every rank (a joiner takes the extras too).
- `committed` (new group): one `all_ok` vote over the new group.
- `departed`: `departure.depart` (termination message, @on_drain hooks, exit or the loop).
"""
from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from spotguard.hooks.adapters.base import ResizableAdapter, resizable_adapter
from spotguard.hooks.agreement.base import Verdict
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, MembershipView
from spotguard.hooks.checkpoint.store_channel import StoreChannel
from spotguard.hooks.elastic.transfer import HeldState, hand_over, load, receive
from spotguard.hooks.group_session import GroupSession
from spotguard.hooks.machine.checkpoint import Checkpoint
from spotguard.hooks.machine.decide import Decision, Drain, Resize, Settle, decide
from spotguard.hooks.machine.departure import Departure, depart
from spotguard.hooks.machine.effects import Effects
from spotguard.hooks.machine.model import Phase, Role, StepRecord
from spotguard.wire.notice import Notice

if TYPE_CHECKING:
    from spotguard.hooks.adapters.base import CheckpointAdapter

log = logging.getLogger("spotguard.hooks.elastic")


LINGER_MARGIN = 2.0  # seconds of a notice the rank serving the old store keeps for its own departure


class End(enum.Enum):
    DEPART = "the rank's failed outcome (fallback, leave, drain), then the departure"
    RAISE = "the exception propagates (the groups abandoned first)"


class NotDurable(RuntimeError):
    """A change's checkpoint failed on some rank (every rank learns it in the vote) while someone
    leaves: nobody leaves the old group for the new one, every rank departs with 84."""


@dataclass
class Walk:
    """What one walk of the table carries from phase to phase (the executor makes it)."""

    step: int
    record: StepRecord
    session: GroupSession
    effects: Effects
    view: MembershipView | None
    departure: Departure
    deadline: float  # time.monotonic() by which this walk ends on every rank
    verdict: Verdict | None = None
    role: Role = Role.UNDECIDED
    notice: Notice | None = None
    decision: Decision | None = None
    checkpoint: Checkpoint | None = None
    held: HeldState | None = None
    store: str = ""  # "host:port" of the new group's leader's store
    ahead: bool = False  # the change's checkpoint commits through the old formation's store (`writes_ahead`)
    limit: float = 0.0  # the seconds this row may still take: to the deadline (the executor sets it)
    peer_limit: float = 0.0  # the seconds any one wait of this row on a peer may take (likewise)

    @property
    def collectives(self) -> Collectives:
        return self.effects.collectives()

    @property
    def adapter(self) -> CheckpointAdapter | None:
        return self.effects.adapter()

    def resizable(self) -> ResizableAdapter:
        adapter = resizable_adapter(self.adapter)
        if adapter is None:
            raise RuntimeError("an in-place change needs an adapter made with build=")
        return adapter

    def resize(self) -> Resize:
        assert isinstance(self.decision, Resize), "a change's row on a walk that is no change"
        return self.decision


# ---- the actions (each raises on failure) ---------------------------------------------------------
def agree_on_notice(walk: Walk) -> None:
    verdict = walk.verdict
    assert verdict is not None
    if not verdict.on_notice:  # a pushed membership, agreed in its own field: its holder sends it
        verdict = Verdict(verdict.membership, verdict.deadline_ts, verdict.membership_source)
    walk.notice = walk.record.notice = agreed_notice(walk.collectives, verdict)
    walk.record.reason = walk.notice.kind.value


def agreed_notice(collectives: Collectives, verdict: Verdict) -> Notice:
    """The notice every rank acts on: the one `verdict.source_rank` contributed, with the agreed deadline."""
    notice = verdict.pending
    if collectives.distributed:
        payload = b""
        if collectives.rank == verdict.source_rank and verdict.pending is not None:
            payload = verdict.pending.to_json().encode()
        notice = Notice.from_json(collectives.broadcast_bytes(payload, verdict.source_rank))
    if notice is None:
        raise ValueError("a verdict without a pending notice (a single process acts only on its own notice)")
    if math.isfinite(verdict.deadline_ts):
        notice = notice.with_deadline(datetime.fromtimestamp(verdict.deadline_ts, UTC))
    return notice


def decide_and_vote(walk: Walk) -> None:
    notice = walk.notice
    assert notice is not None
    resizable = resizable_adapter(walk.adapter) is not None
    decision = decide(notice, walk.step, walk.view, resizable)
    if walk.view is not None and resizable and notice.source == MEMBERSHIP_SOURCE:
        decision = settle_vote(walk, decision)
    take(walk, decision)


def settle_vote(walk: Walk, mine: Decision) -> Decision:
    """Whether an agreed membership settles is rank 0's word on every rank: the stale rule
    compares times read on different ranks' clocks, which must not split the group."""
    notice = walk.notice
    assert notice is not None
    word = walk.collectives.broadcast_bytes(mine.why.encode() if isinstance(mine, Settle) else b"", 0)
    if bool(word) == isinstance(mine, Settle):
        return mine
    if word:
        return Settle(int(notice.detail["generation"]), word.decode(errors="replace"))
    return decide(notice, walk.step, walk.view, True, stale_rule=False)


def take(walk: Walk, decision: Decision) -> None:
    """The role `decision` gives this rank, and what the record and the view learn from it."""
    walk.decision, record, notice = decision, walk.record, walk.notice
    assert notice is not None
    if isinstance(decision, Settle):
        walk.role = Role.SETTLED
        if walk.view is not None:
            walk.view.adopt(decision.generation)
        log.warning("membership %d needs no change (%s): training goes on", decision.generation, decision.why)
    elif isinstance(decision, Drain):
        walk.role = Role.DRAINING
        if walk.view is not None:
            log.warning("notice %s: every rank drains (%s)", notice.id, decision.why)
    else:
        change, plan = decision.change, decision.change.plan
        record.reason, record.old_world_size, record.new_world_size = change.reason, plan.old_world_size, \
            plan.new_world_size
        record.new_rank = plan.new_rank(record.old_rank)
        record.joiners = len(plan.joining_hosts) * plan.procs_per_host
        walk.ahead = writes_ahead(walk)
        staying = Role.STAYING_AHEAD if walk.ahead else Role.STAYING
        walk.role = staying if record.new_rank is not None else Role.LEAVING
        if notice.source == MEMBERSHIP_SOURCE and walk.view is not None:
            walk.view.adopt(change.generation)
    record.outcome = walk.role.outcome


def writes_ahead(walk: Walk) -> bool:
    """Whether this change's checkpoint commits through the old formation's store: a shrink (a
    grow's checkpoint is its fallback, so it is durable before anything is risked) of an adapter
    that `writes_over_channel`, in place. Every rank decides alike: the decision, the adapter's
    class and the session's kind are the same on all of them."""
    adapter = resizable_adapter(walk.adapter)
    return (walk.resize().requires_durable and bool(getattr(adapter, "writes_over_channel", False))
            and walk.session.meeting is not None)


def save_estimate(walk: Walk) -> float:
    adapter = walk.adapter
    return (adapter.estimate_save_seconds() if adapter is not None else None) or 0.0


def start_checkpoint(walk: Walk) -> None:
    assert walk.notice is not None
    for_notice = not isinstance(walk.decision, Resize) or walk.decision.for_notice
    channel = None
    if walk.ahead:
        timeout = walk.session.timeouts.reform + save_estimate(walk)
        channel = StoreChannel(walk.session.meeting_store(timeout), f"spotguard/save/{walk.notice.id}/{walk.step}/",
                               walk.record.old_rank, walk.record.old_world_size, timeout)
    walk.checkpoint = Checkpoint(walk.effects, walk.step, walk.notice, for_notice, channel)
    walk.checkpoint.start()
    if walk.ahead:  # on the group of the agreed step, which is gone by `durable`
        walk.checkpoint.hooks_now()


def finish_checkpoint(walk: Walk) -> None:
    assert walk.checkpoint is not None
    wait, linger = walk.limit, 0.0
    if walk.role is not Role.DRAINING:  # a change: one wait on a peer beyond what a save takes here
        wait = min(wait, walk.peer_limit + save_estimate(walk))
    if walk.role is not Role.STAYING_AHEAD and walk.record.old_rank == 0:  # it serves the old store and exits
        left = walk.notice.seconds_left() if walk.notice is not None else None
        linger = walk.peer_limit if left is None else max(0.0, min(walk.peer_limit, left - LINGER_MARGIN))
    saved = walk.record.saved = walk.checkpoint.finish(wait, linger)
    if not saved.durable and isinstance(walk.decision, Resize) and walk.decision.requires_durable:
        raise NotDurable(f"the checkpoint of step {walk.step} failed: every rank departs")


def hand_over_state(walk: Walk) -> None:
    change, adapter, rendezvous = walk.resize().change, walk.resizable(), walk.session.rendezvous
    assert rendezvous is not None
    plan, old_rank = change.plan, walk.record.old_rank
    walk.held = hand_over(walk.collectives, adapter, walk.step, adapter.extra_state_now(), plan)
    # The first survivor (in target order) serves the new group's store unless its leader
    # is a joiner (whose store the membership names).
    first = plan.first_survivor_old_rank
    if old_rank == first:  # listening before anyone learns the address: a refused connect backs off ~0.6 s
        rendezvous.serve(walk.session.timeouts.reform)
    survivor_store = walk.collectives.broadcast_bytes(rendezvous.address.encode() if old_rank == first else b"",
                                                      first).decode()
    walk.store = survivor_store if plan.leader_old_rank is not None else change.store


def leave_old_groups(walk: Walk) -> None:
    walk.session.leave()


def form_new_group(walk: Walk) -> None:
    change, new_rank = walk.resize().change, walk.record.new_rank
    assert new_rank is not None
    walk.session.reform(walk.store, change.prefix, new_rank, change.plan.new_world_size, walk.peer_limit)


def rebuild(walk: Walk) -> None:
    walk.resizable().rebuild()
    walk.effects.rejoin()
    if walk.view is not None:
        walk.view.learn_hosts(walk.collectives)


def transfer_state(walk: Walk) -> None:
    adapter, joiner = walk.resizable(), walk.held is None
    held = receive(walk.collectives, adapter, walk.held, share_first=joiner or walk.record.joiners > 0)
    load(adapter, held)
    if joiner:
        adapter.extra = dict(held.extra)
    walk.held = held


def commit(walk: Walk) -> None:
    if not walk.collectives.all_ok(True):
        raise RuntimeError("a rank of the new group failed the change")


def depart_now(walk: Walk) -> None:
    depart(walk.record, walk.checkpoint, walk.effects, walk.departure)


# ---- the table ------------------------------------------------------------------------------------
OLD = frozenset({Role.UNDECIDED})
SAVING = frozenset({Role.DRAINING, Role.STAYING, Role.STAYING_AHEAD, Role.LEAVING})
DURABLE_IN_OLD = frozenset({Role.DRAINING, Role.STAYING, Role.LEAVING})
CHANGING = frozenset({Role.STAYING, Role.STAYING_AHEAD, Role.LEAVING})
STAYING = frozenset({Role.STAYING, Role.STAYING_AHEAD})
AHEAD = frozenset({Role.STAYING_AHEAD})
NEW = frozenset({Role.STAYING, Role.STAYING_AHEAD, Role.JOINING})
DEPARTING = frozenset({Role.DRAINING, Role.LEAVING, Role.FAILED})


@dataclass(frozen=True)
class Row:
    phase: Phase  # reached when `action` returns
    action: Callable[[Walk], None]
    who: frozenset[Role]  # the roles that run it
    on_error: End  # where an exception in `action` ends


TABLE: tuple[Row, ...] = (
    #   phase               action              who        on error
    Row(Phase.AGREED, agree_on_notice, OLD, End.RAISE),
    Row(Phase.DECIDED, decide_and_vote, OLD, End.DEPART),
    Row(Phase.CHECKPOINTED, start_checkpoint, SAVING, End.DEPART),
    Row(Phase.HANDOVER, hand_over_state, CHANGING, End.DEPART),  # while the write runs behind
    Row(Phase.DURABLE, finish_checkpoint, DURABLE_IN_OLD, End.DEPART),
    Row(Phase.LEFT, leave_old_groups, CHANGING, End.DEPART),
    Row(Phase.FORMED, form_new_group, STAYING, End.DEPART),
    Row(Phase.REBUILT, rebuild, STAYING, End.DEPART),
    Row(Phase.TRANSFERRED, transfer_state, NEW, End.DEPART),
    Row(Phase.DURABLE, finish_checkpoint, AHEAD, End.DEPART),  # the write committed behind the new group
    Row(Phase.COMMITTED, commit, NEW, End.DEPART),
    Row(Phase.DEPARTED, depart_now, DEPARTING, End.RAISE),
)
