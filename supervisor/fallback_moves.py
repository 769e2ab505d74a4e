"""Prefer spot, fall back to on-demand, come back: the moves, as rows of `policy.TRANSITIONS`. Pure.

Every move is an Event, the record's phase/reason, and the condition `SpotguardOnDemand`:
- fallback: a job the supervisor suspended (after its checkpoint) that has lacked spot capacity
  for its replicas for `fallback-after` (clock: `lacking_since`, set at the notice, else the
  suspension), while on-demand capacity for them is free and the template may change, is resumed
  with its scheduling directives switched to on-demand (the spot ones saved in the record).
  Before `fallback-after` the policy's wait for capacity goes on and looks again at it
  (`fallback_recheck`); without on-demand capacity it simply waits.
- return: a job running on on-demand whose spot capacity for every replica has been free for
  `return-after` (clock: `spot_free_since`, started and reset by a RECORD of the clock alone)
  and that has no departing notice on its nodes gets a drain request (`drain` in the record,
  with a new membership generation that carries it to the pods: membership_plan.py), then, once
  a replica exited 83/84 after it or the checkpoint timeout passed, is suspended; once the API
  server lets the template change (`template_mutable`), it resumes with the saved spot
  directives. If spot capacity vanished in between, it resumes where it was.

`ROWS` are (what holds, what follows) pairs in the policy's first-match order; their conditions
exclude each other by phase, so their order among themselves only reads top-down.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from collections.abc import Callable

from spotguard.supervisor.decision import MOVE, RECORD, RESUME, SUSPEND, Context, Decision, decision_key
from spotguard.supervisor.fallback import ON_DEMAND, SPOT, Fallback, on_demand_directives
from spotguard.supervisor.record import CHECKPOINTING, RUNNING, SUSPENDED
from spotguard.wire import names

Row = tuple[Callable[[Context], bool], Callable[[Context], Decision]]


def _fallback(c: Context) -> Fallback:
    """The job's fallback settings (the rows that read them hold only for a job that has some)."""
    if c.policy.fallback is None:
        raise RuntimeError("a fallback row held for a job without the fallback")
    return c.policy.fallback


def _need(c: Context) -> int:
    return c.rec.replicas or c.state.replicas


def _seconds_since(since: datetime, c: Context) -> float:
    return (c.now - since).total_seconds()


# ---- the return to spot: draining, then suspended until the template may change -------------
def _returning(c: Context) -> bool:
    return c.rec.phase == CHECKPOINTING and bool(c.rec.move_to)


def _return_drained(c: Context) -> bool:
    deadline = c.rec.checkpoint_deadline
    return _returning(c) and (c.state.drained or deadline is None or c.now >= deadline)


def _suspend_to_move(c: Context) -> Decision:
    why = "a replica drained after its checkpoint" if c.state.drained else "the checkpoint timeout passed"
    return c.act(SUSPEND, event=names.EVENT_RETURNING, key=decision_key("return-suspend", c.previous),
                 message=why + f"; suspending to move to {c.rec.move_to} capacity", phase=SUSPENDED, reason="Moving",
                 waiting_since=c.now, replicas=_need(c))


def _moving(c: Context) -> bool:
    return c.rec.phase == SUSPENDED and bool(c.rec.move_to)


def _back_on_spot(c: Context) -> Decision:
    need = _need(c)
    return c.act(MOVE, event=names.EVENT_RETURNED, replicas=need, key=decision_key("return", c.previous),
                 directives=c.rec.spot_directives,
                 message=f"spot capacity for {need} replicas: resuming on spot from the checkpoint",
                 phase=RUNNING, reason="ReturnedToSpot", capacity="", spot_directives=None, move_to="", drain="",
                 waiting_since=None, lacking_since=None, spot_free_since=None)


def _return_abandoned(c: Context) -> Decision:
    need = _need(c)
    return c.act(RESUME, event=names.EVENT_RESUMED, replicas=need, key=decision_key("return-abandoned", c.previous),
                 message=f"spot capacity went away during the return; resuming on {ON_DEMAND} at {need}",
                 phase=RUNNING, reason="ReturnAbandoned", move_to="", drain="", waiting_since=None,
                 spot_free_since=None)


# ---- the fallback to on-demand -------------------------------------------------------------
def _lacking_spot(c: Context) -> bool:
    return (c.policy.fallback is not None and c.rec.phase == SUSPENDED and not c.rec.move_to
            and c.rec.capacity != ON_DEMAND and c.state.free_slots < _need(c))


def _lacking_since(c: Context) -> datetime:
    return c.rec.lacking_since or c.rec.waiting_since or c.rec.decided_at or c.now


def _fallback_due(c: Context) -> datetime:
    return _lacking_since(c) + timedelta(seconds=_fallback(c).after)


def fallback_recheck(c: Context) -> datetime | None:
    """When a suspended job that lacks spot capacity may fall back (None: not waiting for that)."""
    return _fallback_due(c) if _lacking_spot(c) and c.now < _fallback_due(c) else None


def _can_fall_back(c: Context) -> bool:
    return (_lacking_spot(c) and c.now >= _fallback_due(c) and on_demand_directives(c.state.directives) is not None
            and c.state.alt_slots >= _need(c) and c.state.template_mutable)


def _fall_back(c: Context) -> Decision:
    need, fallback, since = _need(c), _fallback(c), _lacking_since(c)
    return c.act(MOVE, event=names.EVENT_FELL_BACK, replicas=need, event_type="Warning",
                 key=decision_key("fallback", c.previous), directives=on_demand_directives(c.state.directives),
                 message=(f"no spot capacity for {need} replicas for {_seconds_since(since, c):.0f}s (fallback-after "
                          f"{fallback.after:g}s): resuming on {ON_DEMAND} capacity from the checkpoint"),
                 phase=RUNNING, reason="FellBackToOnDemand", capacity=ON_DEMAND,
                 spot_directives={r: dict(d) for r, d in c.state.directives.items()},
                 waiting_since=None, lacking_since=None, spot_free_since=None)


# ---- running on on-demand: the return-after clock -------------------------------------------
def _on_demand(c: Context) -> bool:
    return (c.policy.fallback is not None and c.rec.phase == RUNNING and c.rec.capacity == ON_DEMAND
            and not c.state.suspended)


def _spot_free(c: Context) -> bool:
    return c.state.alt_slots >= c.state.replicas and not c.state.notices


def _free_since(c: Context) -> datetime:
    return c.rec.spot_free_since or c.now


def _return_due(c: Context) -> datetime:
    return _free_since(c) + timedelta(seconds=_fallback(c).return_after)


def _spot_busy_again(c: Context) -> Decision:
    return c.note("SpotBusyAgain", f"spot capacity for {c.state.replicas} replicas is gone again before "
                                   f"return-after {_fallback(c).return_after:g}s: the settle clock starts over",
                  spot_free_since=None)


def _spot_free_now(c: Context) -> Decision:
    after = _fallback(c).return_after
    return c.note("SpotFree", f"spot capacity for {c.state.replicas} replicas is free: returning to spot if it "
                              f"stays free for return-after {after:g}s",
                  recheck_at=c.now + timedelta(seconds=after), spot_free_since=c.now)


def _drain_to_return(c: Context) -> Decision:
    key = decision_key("return-drain", c.previous)
    deadline = c.now + timedelta(seconds=c.settings.checkpoint_timeout)
    return c.act(RECORD, event=names.EVENT_RETURNING, key=key, recheck_at=deadline,
                 message=(f"spot capacity for {c.state.replicas} replicas free for "
                          f"{_seconds_since(_free_since(c), c):.0f}s (return-after "
                          f"{_fallback(c).return_after:g}s): draining at a checkpoint to return to spot"),
                 phase=CHECKPOINTING, reason="ReturningToSpot", move_to=SPOT, drain=key,
                 checkpoint_deadline=deadline, replicas=c.state.replicas, generation=c.rec.generation + 1)


ROWS: tuple[Row, ...] = (
    (_return_drained, _suspend_to_move),
    (_returning, lambda c: c.stay(c.rec.checkpoint_deadline)),
    (lambda c: _moving(c) and not c.state.template_mutable, lambda c: c.stay()),  # the pods' end wakes us
    (lambda c: _moving(c) and c.state.alt_slots >= _need(c) and bool(c.rec.spot_directives), _back_on_spot),
    (lambda c: _moving(c) and c.state.free_slots >= _need(c), _return_abandoned),
    (_moving, lambda c: c.stay()),
    (_can_fall_back, _fall_back),
    (lambda c: _on_demand(c) and not _spot_free(c) and c.rec.spot_free_since is not None, _spot_busy_again),
    (lambda c: _on_demand(c) and _spot_free(c) and c.rec.spot_free_since is None, _spot_free_now),
    (lambda c: _on_demand(c) and _spot_free(c) and c.now < _return_due(c), lambda c: c.stay(_return_due(c))),
    (lambda c: _on_demand(c) and _spot_free(c), _drain_to_return),
)
