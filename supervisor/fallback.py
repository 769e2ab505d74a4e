"""Prefer spot, fall back to on-demand, come back: the job's fallback annotations and the move
decisions, as pure functions (policy.decide calls `decide_move` first).

Annotations: `spotguard.io/fallback: on-demand` opts in; `spotguard.io/fallback-after` (default
10m) and `spotguard.io/return-after` (default 5m) are durations ("90s", "10m", "1h30m", "500ms",
or plain seconds). The job's pod template must select spot capacity through a label of
capacity_type.py (checked by the controller).

Moves (every one an Event, the record's phase/reason, and the condition `SpotguardOnDemand`):
- fallback: a job the supervisor suspended (after its checkpoint) that has lacked spot capacity
  for its replicas for `fallback-after` (clock: `lacking_since`, set at the notice, else the
  suspension), while on-demand capacity for them is free, is resumed with its scheduling
  directives switched to on-demand (the spot ones saved in the record).
- return: a job running on on-demand whose spot capacity for every replica has been free for
  `return-after` (clock: `spot_free_since`, reset whenever it is not) and that has no live notice
  on its nodes gets a drain request (`drain` in the record; the controller sends it to the pods
  through the membership annotation), then, once a replica exited 83/84 after it or the
  checkpoint timeout passed, is suspended; once the API server lets the template change
  (`template_mutable`), it resumes with the saved spot directives. If spot capacity vanished in
  between, it resumes where it was.
A Job's template may only change while it is suspended and its `status.startTime` is unset (the
Job controller clears it once the suspended job's pods are gone); a PyTorchJob's may change once
suspended, but its operator recreates only the pods it deleted, so a move also waits until the
job has no active pod left: `template_mutable` says both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING
from collections.abc import Mapping

from spotguard.config import ConfigError
from spotguard.supervisor import capacity_type
from spotguard.supervisor.record import CHECKPOINTING, RUNNING, SUSPENDED
from spotguard.wire import names

if TYPE_CHECKING:
    from spotguard.supervisor.policy import Decision, JobState, Settings

ON_DEMAND, SPOT = capacity_type.ON_DEMAND, capacity_type.SPOT
DEFAULT_FALLBACK_AFTER = 600.0
DEFAULT_RETURN_AFTER = 300.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Fallback:
    """A job's validated fallback settings (seconds)."""

    after: float = DEFAULT_FALLBACK_AFTER
    return_after: float = DEFAULT_RETURN_AFTER


def parse_duration(field: str, raw: object) -> float:
    """Seconds > 0 from a Go-style duration ("1h30m", "90s", "500ms") or plain seconds; else
    ConfigError naming `field`."""
    text = str(raw).strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION.findall(text)
        seconds = sum(float(n) * _UNITS[u] for n, u in parts) if "".join(n + u for n, u in parts) == text else -1.0
    if not (0 < seconds < float("inf")):
        raise ConfigError(field, f"expected a duration > 0 such as 90s, 10m or 1h30m, got {raw!r}")
    return seconds


def parse_fallback(annotations: Mapping[str, str]) -> Fallback | None:
    """The job's fallback settings, None when it did not opt in; ConfigError names a bad annotation."""
    raw = annotations.get(names.ANN_FALLBACK)
    if raw is None:
        return None
    if str(raw).strip() != ON_DEMAND:
        raise ConfigError(names.ANN_FALLBACK, f"expected {ON_DEMAND!r}, got {raw!r}")
    after, back = DEFAULT_FALLBACK_AFTER, DEFAULT_RETURN_AFTER
    if names.ANN_FALLBACK_AFTER in annotations:
        after = parse_duration(names.ANN_FALLBACK_AFTER, annotations[names.ANN_FALLBACK_AFTER])
    if names.ANN_RETURN_AFTER in annotations:
        back = parse_duration(names.ANN_RETURN_AFTER, annotations[names.ANN_RETURN_AFTER])
    return Fallback(after, back)


def on_demand_directives(directives: Mapping[str, Mapping]) -> dict[str, dict] | None:
    """Per pod role, the on-demand form of its directives (roles selecting no spot stay as they
    are); None when no role selects spot capacity."""
    out: dict[str, dict] = {}
    switched = False
    for role, current in directives.items():
        moved = capacity_type.to_on_demand(current)
        switched = switched or moved is not None
        out[role] = moved if moved is not None else dict(current)
    return out if switched else None


def _seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def decide_move(state: JobState, now: datetime, settings: Settings, identity: str) -> Decision | None:
    """The move decision for `state` (module docstring), or None to let the policy decide."""
    from spotguard.supervisor.policy import MOVE, NONE, RECORD, RESUME, SUSPEND, Decision, _act, decision_key

    rec, fallback = state.record, state.policy.fallback
    if fallback is None and not rec.move_to:
        return None
    previous = rec.key or (rec.decided_at.isoformat() if rec.decided_at else "")
    need = rec.replicas or state.replicas

    if rec.phase == CHECKPOINTING and rec.move_to:
        deadline = rec.checkpoint_deadline or now
        if not (state.drained or now >= deadline):
            return Decision(NONE, rec, recheck_at=deadline)
        why = "a replica drained after its checkpoint" if state.drained else "the checkpoint timeout passed"
        return _act(SUSPEND, state, now, identity, event=names.EVENT_RETURNING,
                    key=decision_key("return-suspend", previous),
                    message=why + f"; suspending to move to {rec.move_to} capacity", phase=SUSPENDED, reason="Moving",
                    waiting_since=now, replicas=need)

    if rec.phase == SUSPENDED and rec.move_to:
        if not state.template_mutable:
            return Decision(NONE, rec)  # the pods' deletion / the Job's startTime cleared wakes us
        if state.alt_slots >= need and rec.spot_directives:
            return _act(MOVE, state, now, identity, event=names.EVENT_RETURNED, replicas=need,
                        key=decision_key("return", previous), directives=rec.spot_directives,
                        message=f"spot capacity for {need} replicas: resuming on spot from the checkpoint",
                        phase=RUNNING, reason="ReturnedToSpot", capacity="", spot_directives=None, move_to="",
                        drain="", waiting_since=None, lacking_since=None, spot_free_since=None)
        if state.free_slots >= need:
            return _act(RESUME, state, now, identity, event=names.EVENT_RESUMED, replicas=need,
                        key=decision_key("return-abandoned", previous),
                        message=f"spot capacity went away during the return; resuming on {ON_DEMAND} at {need}",
                        phase=RUNNING, reason="ReturnAbandoned", move_to="", drain="", waiting_since=None,
                        spot_free_since=None)
        return Decision(NONE, rec)

    if fallback is None:
        return None

    if rec.phase == SUSPENDED and rec.capacity != ON_DEMAND and state.free_slots < need:
        since = rec.lacking_since or rec.waiting_since or rec.decided_at or now
        due = since + timedelta(seconds=fallback.after)
        if now < due:
            return Decision(NONE, rec, recheck_at=due)
        target = on_demand_directives(state.directives)
        if target is None or state.alt_slots < need or not state.template_mutable:
            return None  # nothing to switch, or no on-demand capacity either: the policy waits
        return _act(MOVE, state, now, identity, event=names.EVENT_FELL_BACK, replicas=need, event_type="Warning",
                    key=decision_key("fallback", previous), directives=target,
                    message=(f"no spot capacity for {need} replicas for {_seconds(since, now):.0f}s (fallback-after "
                             f"{fallback.after:g}s): resuming on {ON_DEMAND} capacity from the checkpoint"),
                    phase=RUNNING, reason="FellBackToOnDemand", capacity=ON_DEMAND,
                    spot_directives={r: dict(d) for r, d in state.directives.items()},
                    waiting_since=None, lacking_since=None, spot_free_since=None)

    if rec.phase == RUNNING and rec.capacity == ON_DEMAND and not state.suspended:
        free = state.alt_slots >= state.replicas and not state.notices
        if not free:
            if rec.spot_free_since is None:
                return None  # the policy handles notices and scaling as usual
            return Decision(RECORD, rec.with_(spot_free_since=None), reason="SpotBusyAgain",
                            message=(f"spot capacity for {state.replicas} replicas is gone again before "
                                     f"return-after {fallback.return_after:g}s: the settle clock starts over"))
        if rec.spot_free_since is None:
            return Decision(RECORD, rec.with_(spot_free_since=now), reason="SpotFree",
                            message=(f"spot capacity for {state.replicas} replicas is free: returning to spot "
                                     f"if it stays free for return-after {fallback.return_after:g}s"),
                            recheck_at=now + timedelta(seconds=fallback.return_after))
        due = rec.spot_free_since + timedelta(seconds=fallback.return_after)
        if now < due:
            return Decision(NONE, rec, recheck_at=due)
        key = decision_key("return-drain", previous)
        deadline = now + timedelta(seconds=settings.checkpoint_timeout)
        return _act(RECORD, state, now, identity, event=names.EVENT_RETURNING, key=key, recheck_at=deadline,
                    message=(f"spot capacity for {state.replicas} replicas free for "
                             f"{_seconds(rec.spot_free_since, now):.0f}s (return-after {fallback.return_after:g}s): "
                             "draining at a checkpoint to return to spot"),
                    phase=CHECKPOINTING, reason="ReturningToSpot", move_to=SPOT, drain=key,
                    checkpoint_deadline=deadline, replicas=state.replicas, generation=rec.generation + 1)
    return None
