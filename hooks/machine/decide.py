"""What an agreed notice asks of this rank's group, pure: `decide(notice, step, view, resizable)`.

- `Drain(why)`: every rank checkpoints the agreed step and leaves (not in place, an adapter that
  cannot resize, a notice for the whole job, one naming no host of the group, fewer than
  `min_world_size` ranks left, a membership that cannot be a group).
- `Settle(generation, why)`: an agreed membership that asks nothing (its hosts are the group's,
  or it was written before one of its hosts left): the view adopts its generation, training goes on.
- `Resize(change)`: re-form the group in place (`membership_view.Change`): a notice naming one
  host of the group (it leaves, the others stay) or a membership whose hosts differ.
  `requires_durable`: someone leaves, so a checkpoint that is not durable ends the change on
  every rank (a grow's failed save goes on, not durable); `for_notice`: its checkpoint is the
  notice's (the save decision, the @on_reclaim hooks, reports), not a grow's own save.
`stale_rule=False` never settles a membership for having been written before a host left (the
settle vote: rank 0 found it current, and its word holds on every rank). No I/O, no clock: the
view's state and the notice decide.
"""
from __future__ import annotations

from dataclasses import dataclass

from spotguard.hooks.elastic.membership_view import Change, MembershipView, Settled
from spotguard.wire.notice import Notice


@dataclass(frozen=True)
class Drain:
    why: str


@dataclass(frozen=True)
class Settle:
    generation: int
    why: str


@dataclass(frozen=True)
class Resize:
    change: Change

    @property
    def requires_durable(self) -> bool:
        return bool(self.change.plan.leaving_hosts)

    @property
    def for_notice(self) -> bool:
        return bool(self.change.plan.leaving_hosts)


Decision = Drain | Settle | Resize


def decide(notice: Notice, step: int, view: MembershipView | None, resizable: bool, *,
           stale_rule: bool = True) -> Decision:
    """See the module docstring."""
    if view is None:
        return Drain("not in place")
    if not resizable:
        return Drain("the adapter cannot resize in place (made without build=)")
    try:
        planned = view.plan_for(notice, step, settle=stale_rule)
    except ValueError as exc:  # a membership that cannot be a group
        return Drain(f"membership change not possible in place ({exc})")
    if planned is None:
        return Drain("the notice asks every rank to leave")
    if isinstance(planned, Settled):
        return Settle(planned.generation, planned.why)
    return Resize(planned)
