"""Policies: the job's policy annotations, and the decision as a pure function of the job's state.

Nothing here talks to Kubernetes: `decide(state, now, settings)` maps what the controller saw
(the job's replicas, the live notices on its nodes, the capacity left, its decision record) to
one `Decision`. The same state and time always give the same decision, which is what lets a
restarted supervisor, or the local dry-run, reproduce it.

Policies (annotation `spotguard.io/policy`, default `fixed`):
- elastic: on a new notice, scale to the replicas running on unaffected nodes when that is
  >= min, else suspend ("below min"); scale back out toward max as capacity returns (no sooner
  than `scale_out_delay` after the last decision, so a flapping node does not thrash the job).
- fixed: on a new notice, wait for the checkpoint (a replica exits 83/84, or the notice
  deadline, or `checkpoint_timeout` when the notice has none), then suspend; resume when
  capacity for all replicas exists.
- a suspended job that cannot get its minimum within `max-wait` seconds stops waiting
  (phase GaveUp): it stays suspended and the supervisor no longer resumes it.
- `spotguard.io/fallback: on-demand`: moves between spot and on-demand capacity (fallback.py,
  consulted first).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Mapping

from spotguard.config import ConfigError
from spotguard.supervisor import fallback as fallback_rules
from spotguard.supervisor.record import CHECKPOINTING, GAVE_UP, RUNNING, SUSPENDED, Record
from spotguard.wire import names

ELASTIC, FIXED = "elastic", "fixed"
POLICIES = (ELASTIC, FIXED)
DEFAULT_POLICY = FIXED

# Decision actions
NONE = "none"  # nothing to do (maybe recheck later)
SCALE = "scale"  # set the job's replicas
SUSPEND = "suspend"
RESUME = "resume"  # unsuspend at `replicas`
RECORD = "record"  # only the decision record changes (checkpoint wait, give-up)
MOVE = "move"  # switch the pod template's scheduling directives and unsuspend at `replicas`


class PolicyError(ConfigError):
    """A policy annotation is invalid. `field` is the annotation's full name."""


@dataclass(frozen=True)
class Policy:
    """A job's validated policy. `max_wait` None means wait for capacity forever."""

    mode: str
    min_replicas: int
    max_replicas: int
    max_wait: float | None = None
    fallback: fallback_rules.Fallback | None = None


def _int_annotation(annotations: Mapping[str, str], name: str) -> int | None:
    raw = annotations.get(name)
    if raw is None:
        return None
    text = str(raw).strip()
    if not text.isdigit() or int(text) < 1:
        raise PolicyError(name, f"expected a whole number >= 1, got {raw!r}")
    return int(text)


def parse_policy(annotations: Mapping[str, str] | None, default_max: int, default_min: int | None = None) -> Policy:
    """Validates the job's policy annotations; PolicyError names the first bad annotation.

    Defaults: policy `fixed`; max-replicas = `default_max` (the job's full size, from the adapter);
    min-replicas = `default_min` or 1 (elastic) / max (fixed); max-wait unset = no bound.
    """
    annotations = annotations or {}
    mode = str(annotations.get(names.ANN_POLICY, DEFAULT_POLICY)).strip()
    if mode not in POLICIES:
        raise PolicyError(names.ANN_POLICY, f"expected one of {', '.join(POLICIES)}, got {mode!r}")
    max_replicas = _int_annotation(annotations, names.ANN_MAX_REPLICAS) or max(1, default_max)
    min_replicas = _int_annotation(annotations, names.ANN_MIN_REPLICAS)
    if min_replicas is None:
        min_replicas = min(default_min or 1, max_replicas) if mode == ELASTIC else max_replicas
    if min_replicas > max_replicas:
        raise PolicyError(names.ANN_MIN_REPLICAS, f"{min_replicas} is above {names.ANN_MAX_REPLICAS} ({max_replicas})")
    max_wait = None
    raw_wait = annotations.get(names.ANN_MAX_WAIT)
    if raw_wait is not None:
        try:
            max_wait = float(str(raw_wait).strip())
        except ValueError:
            max_wait = -1.0
        if not (max_wait > 0 and max_wait < float("inf")):
            raise PolicyError(names.ANN_MAX_WAIT, f"expected seconds > 0, got {raw_wait!r}")
    try:
        fallback = fallback_rules.parse_fallback(annotations)
    except ConfigError as exc:
        raise PolicyError(exc.field, exc.message) from None
    return Policy(mode, min_replicas, max_replicas, max_wait, fallback)


@dataclass(frozen=True)
class NoticeHit:
    """A live notice on a node that runs at least one of the job's replicas."""

    id: str
    node: str
    kind: str
    deadline: datetime | None = None


@dataclass(frozen=True)
class JobState:
    """What the controller saw of one job, reduced to what decisions depend on.

    `healthy_replicas`: active replica pods on nodes without a notice; `free_slots`: further
    replicas of this job's pod shape that fit on healthy, schedulable nodes; `drained`: a
    replica exited 83/84 (the Guard drained after its checkpoint). Fallback (fallback.py):
    `directives` are the pod roles' scheduling directives now; `alt_slots` the free slots on the
    other capacity (on-demand while on spot, the saved spot directives while on on-demand);
    `template_mutable` whether the API server lets the template change now and the job's active
    pods (made from the old template) are gone, so that the new one reaches every replica.
    """

    policy: Policy
    replicas: int
    suspended: bool
    record: Record
    notices: tuple[NoticeHit, ...] = ()
    healthy_replicas: int = 0
    free_slots: int = 0
    drained: bool = False
    directives: Mapping[str, Mapping] = field(default_factory=dict)
    alt_slots: int = 0
    template_mutable: bool = False


@dataclass(frozen=True)
class Settings:
    """Supervisor-wide timings for decisions (seconds)."""

    checkpoint_timeout: float = 120.0
    scale_out_delay: float = 30.0


@dataclass(frozen=True)
class Decision:
    """One decision: the action, the record to write with it, and the Event that explains it.

    `replicas` is the target for SCALE/RESUME/MOVE; `directives` the scheduling directives per
    pod role that MOVE writes. `key` is the idempotency key (empty for NONE).
    `recheck_at` asks the controller to look again then even if nothing changes.
    """

    action: str
    record: Record
    replicas: int | None = None
    reason: str = ""
    message: str = ""
    event_type: str = "Normal"
    key: str = ""
    recheck_at: datetime | None = None
    directives: Mapping[str, Mapping] | None = None

    @property
    def acts(self) -> bool:
        return self.action != NONE


def decision_key(*parts: object) -> str:
    """A short, deterministic idempotency key over the decision's identifying parts."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _act(action: str, state: JobState, now: datetime, identity: str, *, event: str, message: str, key: str,
         replicas: int | None = None, event_type: str = "Normal", recheck_at: datetime | None = None,
         directives: Mapping[str, Mapping] | None = None, **changes) -> Decision:
    if replicas is not None:
        changes["replicas"] = replicas
    record = state.record.with_(decided_at=now, decided_by=identity, event=event, message=message, key=key, **changes)
    return Decision(action, record, replicas=replicas, reason=event, message=message, event_type=event_type, key=key,
                    recheck_at=recheck_at, directives=directives)


def decide(state: JobState, now: datetime, settings: Settings = Settings(), identity: str = "") -> Decision:
    """The decision for `state` at `now` (see the module docstring for the policies)."""
    rec, policy = state.record, state.policy
    elastic = policy.mode == ELASTIC
    previous = rec.key or (rec.decided_at.isoformat() if rec.decided_at else "")

    if rec.phase == GAVE_UP:
        return Decision(NONE, rec)

    move = fallback_rules.decide_move(state, now, settings, identity)
    if move is not None and (move.acts or move.recheck_at is None or rec.phase != SUSPENDED):
        return move
    fallback_recheck = move.recheck_at if move is not None else None

    if rec.phase == SUSPENDED:
        need = policy.min_replicas if elastic else (rec.replicas or policy.max_replicas)
        slots = state.free_slots
        if slots >= need:
            target = min(policy.max_replicas, slots) if elastic else need
            return _act(RESUME, state, now, identity, event=names.EVENT_RESUMED, replicas=target,
                        key=decision_key("resume", previous, target),
                        message=f"capacity for {target} replicas returned (needed {need}); resuming at {target}",
                        phase=RUNNING, reason="CapacityReturned", waiting_since=None, lacking_since=None)
        waiting_since = rec.waiting_since or rec.decided_at or now
        if policy.max_wait is not None:
            expiry = waiting_since + timedelta(seconds=policy.max_wait)
            if now >= expiry:
                return _act(RECORD, state, now, identity, event=names.EVENT_MAX_WAIT, event_type="Warning",
                            key=decision_key("give-up", previous),
                            message=(f"waited {policy.max_wait:g}s (max-wait) without capacity for {need} replicas "
                                     f"({slots} available): no longer waiting, the job stays suspended"),
                            phase=GAVE_UP, reason="MaxWaitExceeded")
            return Decision(NONE, rec, recheck_at=min(expiry, fallback_recheck or expiry))
        return Decision(NONE, rec, recheck_at=fallback_recheck)

    if state.suspended:
        return Decision(NONE, rec)  # suspended by someone else: not ours to resume

    new = sorted((n for n in state.notices if n.id not in rec.handled), key=lambda n: n.id)
    if new:
        ids = tuple(n.id for n in new)
        nodes = ", ".join(sorted({n.node for n in new}))
        handled = rec.handled_add(*ids)
        if not elastic:
            if rec.phase == CHECKPOINTING:
                return _act(RECORD, state, now, identity, event=names.EVENT_NOTED, key=decision_key("noted", *ids),
                            message=f"further notice on {nodes} while waiting for the checkpoint", handled=handled,
                            recheck_at=rec.checkpoint_deadline)
            deadlines = [n.deadline for n in new if n.deadline is not None]
            deadline = min(deadlines) if deadlines else now + timedelta(seconds=settings.checkpoint_timeout)
            return _act(RECORD, state, now, identity, event=names.EVENT_CHECKPOINTING, key=decision_key("checkpoint", *ids),
                        message=(f"notice {', '.join(ids)} on {nodes}: waiting for the checkpoint (a replica exits "
                                 f"{names.EXIT_PREEMPTED}/{names.EXIT_CHECKPOINT_FAILED}) until "
                                 f"{deadline.isoformat()}, then suspending"),
                        recheck_at=deadline, phase=CHECKPOINTING, reason="NoticeReceived", handled=handled,
                        checkpoint_deadline=deadline, replicas=state.replicas, lacking_since=rec.lacking_since or now)
        target = min(state.healthy_replicas, policy.max_replicas)
        if target >= policy.min_replicas:
            return _act(SCALE, state, now, identity, event=names.EVENT_SCALED, replicas=target,
                        key=decision_key("scale", *ids),
                        message=(f"notice {', '.join(ids)} on {nodes}: scaling from {state.replicas} to the {target} "
                                 f"replicas on unaffected nodes (min {policy.min_replicas})"),
                        phase=RUNNING, reason="NoticeScaledDown", handled=handled,
                        reclaims_survived=rec.reclaims_survived + 1)
        return _act(SUSPEND, state, now, identity, event=names.EVENT_SUSPENDED, key=decision_key("suspend", *ids),
                    message=(f"notice {', '.join(ids)} on {nodes}: only {target} replicas on unaffected nodes, below "
                             f"min {policy.min_replicas}; suspending until capacity returns"),
                    phase=SUSPENDED, reason="BelowMin", handled=handled, replicas=state.replicas, waiting_since=now,
                    lacking_since=now)

    if rec.phase == CHECKPOINTING:
        deadline = rec.checkpoint_deadline or now
        if state.drained or now >= deadline:
            restore = rec.replicas or state.replicas
            return _act(SUSPEND, state, now, identity, event=names.EVENT_SUSPENDED, key=decision_key("suspend", previous),
                        message=("a replica drained after its checkpoint" if state.drained else
                                 "the notice deadline passed") + f"; suspending, to resume at {restore} replicas",
                        phase=SUSPENDED, reason="Checkpointed" if state.drained else "DeadlineReached",
                        waiting_since=now, replicas=restore, reclaims_survived=rec.reclaims_survived + 1)
        return Decision(NONE, rec, recheck_at=deadline)

    if elastic:
        desired = min(policy.max_replicas, state.healthy_replicas + state.free_slots)
        if desired > state.replicas:
            ready_at = (rec.decided_at or now) + timedelta(seconds=settings.scale_out_delay)
            if rec.decided_at is not None and now < ready_at:
                return Decision(NONE, rec, recheck_at=ready_at)
            return _act(SCALE, state, now, identity, event=names.EVENT_SCALED, replicas=desired,
                        key=decision_key("scale-out", previous, desired),
                        message=f"capacity returned: scaling out from {state.replicas} to {desired} (max {policy.max_replicas})",
                        phase=RUNNING, reason="CapacityReturned")
    return Decision(NONE, rec)


def needs_capacity(state_policy: Policy, record: Record, replicas: int, suspended: bool) -> bool:
    """Whether `decide` would look at `free_slots` / `alt_slots` (so the controller can skip
    computing them)."""
    if record.phase == SUSPENDED or (state_policy.fallback is not None and record.capacity == fallback_rules.ON_DEMAND):
        return True
    return state_policy.mode == ELASTIC and not suspended and record.phase == RUNNING and replicas < state_policy.max_replicas
