"""Policies: the job's policy annotations, and the decision as a pure function of the job's state.

Nothing here talks to Kubernetes: `decide(state, now, settings)` maps what the controller saw
(the job's replicas, the departing notices on its nodes, the capacity left, its pods, its
decision record) to one `Decision`: the first of `TRANSITIONS` (phase and state conditions, in
order) that holds decides the action, and the membership the job's pods are told follows from
the decision's record (membership_plan.py), with the steps lost its drained pods reported. What
differs between the policies is a strategy (strategies.py); the moves between spot and on-demand
are rows too (fallback_moves.py). The same state and time always give the same decision, which
is what lets a restarted supervisor, or the local dry-run, reproduce it.

Notices are read through `spotguard.wire.notice_policy`, nowhere else: only a departure is a
notice the policy acts on (`JobState.notices`); a rebalance or a maintenance beyond the horizon
changes nothing until its release (`JobState.release_at`, when the decision looks again).

Policies (annotation `spotguard.io/policy`, default `fixed`), strategies.py:
- elastic: scale to the survivors of a departure (suspend below min), back out toward max;
- elastic + `spotguard.io/in-place: "true"`: a departure only records itself;
- fixed: a departure starts a checkpoint wait (phase Checkpointing) that ends when a replica
  drained (suspend), when every notice it waits for is withdrawn while its node still exists
  (back to Running, nothing suspended), or at the deadline (suspend);
- a suspended job that cannot get its minimum within `max-wait` seconds stops waiting
  (phase GaveUp): it stays suspended and the supervisor no longer resumes it;
- `spotguard.io/fallback: on-demand`: moves between spot and on-demand capacity.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spotguard.config import ConfigError
from spotguard.supervisor import capacity_type, fallback_moves, membership_plan, progress
from spotguard.supervisor import fallback as fallback_rules
from spotguard.supervisor.decision import (ELASTIC, FIXED, MOVE, NONE, RECORD, RESUME, SCALE, SUSPEND, Context,
                                           Decision, JobState, NoticeHit, Policy, Settings, decision_key, earliest)
from spotguard.supervisor.in_place import wants_in_place
from spotguard.supervisor.record import CHECKPOINTING, GAVE_UP, RUNNING, SUSPENDED, Record
from spotguard.supervisor.strategies import strategy_of
from spotguard.wire import names
from spotguard.wire.injection import HORIZON_FIELD, job_horizon

__all__ = [
    "DEFAULT_POLICY",
    "ELASTIC",
    "FIXED",
    "MOVE",
    "NONE",
    "POLICIES",
    "RECORD",
    "RESUME",
    "SCALE",
    "SUSPEND",
    "TRANSITIONS",
    "Decision",
    "JobState",
    "NoticeHit",
    "Policy",
    "PolicyError",
    "Settings",
    "check_spare",
    "check_template",
    "decide",
    "decision_key",
    "needs_capacity",
    "parse_policy",
]

POLICIES = (ELASTIC, FIXED)
DEFAULT_POLICY = FIXED


class PolicyError(ConfigError):
    """A policy setting is invalid. `field` is the annotation's full name, or the pod template's
    env entry (the notice horizon)."""

    @property
    def setting(self) -> str:
        """What the field is, for messages: "annotation" or "pod template entry"."""
        return "annotation" if self.field.startswith(names.PREFIX) else "pod template entry"


def _int_annotation(annotations: Mapping[str, str], name: str) -> int | None:
    raw = annotations.get(name)
    if raw is None:
        return None
    text = str(raw).strip()
    if not text.isdigit() or int(text) < 1:
        raise PolicyError(name, f"expected a whole number >= 1, got {raw!r}")
    return int(text)


def parse_policy(annotations: Mapping[str, str] | None, default_max: int, default_min: int | None = None,
                 pod_specs: Sequence[Mapping[str, Any]] = ()) -> Policy:
    """Validates the job's policy annotations; PolicyError names the first bad annotation.

    Defaults: policy `fixed`; max-replicas = `default_max` (the job's full size, from the adapter);
    min-replicas = `default_min` or 1 (elastic) / max (fixed); max-wait unset = no bound. The
    notice horizon is the one the job's pod roles set for their Guards (`pod_specs`, one per
    role, read by `spotguard.wire.injection.job_horizon`, each as the injector reads it for the
    sidecar; default 120 s); a bad one, or roles that differ, is a PolicyError naming the env entry.
    """
    annotations = annotations or {}
    try:
        horizon = job_horizon(pod_specs)
    except ValueError as exc:
        raise PolicyError(HORIZON_FIELD, str(exc).removeprefix(f"{HORIZON_FIELD}: ")) from None
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
    try:
        in_place = wants_in_place(annotations)
    except ValueError as exc:
        raise PolicyError(names.ANN_IN_PLACE, str(exc)) from None
    if in_place and mode != ELASTIC:
        raise PolicyError(names.ANN_IN_PLACE, f"needs {names.ANN_POLICY}: {ELASTIC} (got {mode!r})")
    try:
        start_at_min = wants_in_place(annotations, names.ANN_START_AT_MIN)
    except ValueError as exc:
        raise PolicyError(names.ANN_START_AT_MIN, str(exc)) from None
    if start_at_min and not in_place:
        raise PolicyError(names.ANN_START_AT_MIN, f"needs {names.ANN_IN_PLACE}: \"true\"")
    on_demand_max = _int_annotation(annotations, names.ANN_ON_DEMAND_MAX)
    if on_demand_max is not None:
        if fallback is None:
            raise PolicyError(names.ANN_ON_DEMAND_MAX, f"needs {names.ANN_FALLBACK}: {fallback_rules.ON_DEMAND}")
        if on_demand_max > max_replicas:
            raise PolicyError(names.ANN_ON_DEMAND_MAX,
                              f"{on_demand_max} is above {names.ANN_MAX_REPLICAS} ({max_replicas})")
    return Policy(mode, min_replicas, max_replicas, max_wait, fallback, in_place, on_demand_max, start_at_min,
                  horizon)


def check_template(policy: Policy, directives: Mapping[str, Mapping], record: Record) -> None:
    """PolicyError naming `spotguard.io/fallback` when the job opted in to the fallback but no pod
    role's `nodeSelector` or required node affinity names a capacity-type label
    (capacity_type.py): nothing would tell its spot pods from on-demand ones. A job the
    supervisor already moved to on-demand (its spot directives saved) passes."""
    if policy.fallback is None or record.capacity == fallback_rules.ON_DEMAND:
        return
    if not any(capacity_type.names_capacity_label(d) for d in directives.values()):
        labels = ", ".join(label.key for label in capacity_type.CAPACITY_LABELS)
        raise PolicyError(names.ANN_FALLBACK, "the pod template's nodeSelector / required node affinity names no "
                                              f"capacity-type label ({labels}): nothing tells spot from on-demand")


def check_spare(policy: Policy, replicas: int, places_pods: bool) -> None:
    """PolicyError naming `spotguard.io/start-at-min` when a job asks for more replicas than
    max-replicas without starting at min. The replicas above max are spares (placement.py) only
    for a job whose pods the supervisor places (in place, fallback on, gated template) and whose
    ranks come from the supervisor's memberships (start at min); elsewhere the launcher would
    number the ranks by completion index, and a spare's index is any."""
    if replicas > policy.max_replicas and places_pods and not policy.start_at_min:
        raise PolicyError(names.ANN_START_AT_MIN, f"{replicas} replicas, above {names.ANN_MAX_REPLICAS} "
                                                  f"({policy.max_replicas}): a spare replica needs "
                                                  f"{names.ANN_START_AT_MIN}: \"true\"")


def _wait_for_capacity(c: Context) -> Decision:
    """A job we suspended: resume once its need fits, give up after max-wait, else wait (and look
    again when the fallback to on-demand may be due)."""
    rec, policy, strategy = c.rec, c.policy, strategy_of(c.policy)
    need = strategy.resume_need(c)
    slots = c.state.free_slots
    if slots >= need:
        target = strategy.resume_target(c, need, slots)
        return c.act(RESUME, event=names.EVENT_RESUMED, replicas=target, key=decision_key("resume", c.previous, target),
                     message=f"capacity for {target} replicas returned (needed {need}); resuming at {target}",
                     phase=RUNNING, reason="CapacityReturned", waiting_since=None, lacking_since=None)
    waiting_since = rec.waiting_since or rec.decided_at or c.now
    fallback_due = fallback_moves.fallback_recheck(c)
    if policy.max_wait is None:
        return c.stay(fallback_due)
    expiry = waiting_since + timedelta(seconds=policy.max_wait)
    if c.now >= expiry:
        return c.act(RECORD, event=names.EVENT_MAX_WAIT, event_type="Warning", key=decision_key("give-up", c.previous),
                     message=(f"waited {policy.max_wait:g}s (max-wait) without capacity for {need} replicas "
                              f"({slots} available): no longer waiting, the job stays suspended"),
                     phase=GAVE_UP, reason="MaxWaitExceeded")
    return c.stay(earliest(expiry, fallback_due))


# ---- the checkpoint wait (fixed policy) ------------------------------------------------------
def _checkpointing(c: Context) -> bool:
    return c.rec.phase == CHECKPOINTING


def _deadline(c: Context) -> datetime:
    return c.rec.checkpoint_deadline or c.now


def _withdrawn(c: Context) -> bool:
    """Every notice the checkpoint wait is for was withdrawn: a node's notice (never a pod's
    disruption) no longer departs while its Node still exists. A Node that is gone departed: its
    notice went with it, and the wait goes on to its end as for any departure (so does a state
    without the view of the nodes, which cannot tell the two apart)."""
    awaiting, pods = c.rec.awaiting, c.state.pods
    live = {n.id for n in c.state.notices}
    return bool(awaiting) and pods is not None and all(node and node in pods.nodes and notice not in live
                                                       for notice, node in (awaiting or {}).items())


def _suspend_after_checkpoint(c: Context) -> Decision:
    rec, drained = c.rec, c.state.drained
    restore = rec.replicas or c.state.replicas
    return c.act(SUSPEND, event=names.EVENT_SUSPENDED, key=decision_key("suspend", c.previous),
                 message=("a replica drained after its checkpoint" if drained else
                          "the notice deadline passed") + f"; suspending, to resume at {restore} replicas",
                 phase=SUSPENDED, reason="Checkpointed" if drained else "DeadlineReached",
                 waiting_since=c.now, replicas=restore, reclaims_survived=rec.reclaims_survived + 1, awaiting=None)


def _keep_running(c: Context) -> Decision:
    """The notices were withdrawn before any replica drained: the wait ends, nothing is
    suspended, and the notices may act again if they come back."""
    awaiting = c.rec.awaiting or {}
    ids = sorted(awaiting)
    nodes = ", ".join(sorted(set(awaiting.values())))
    return c.act(RECORD, event=names.EVENT_NOTICE_WITHDRAWN, key=decision_key("withdrawn", c.previous),
                 message=(f"notice {', '.join(ids)} on {nodes} withdrawn before its deadline and before any replica "
                          f"drained: the checkpoint wait ends, the job keeps running at {c.state.replicas} replicas"),
                 phase=RUNNING, reason="NoticeWithdrawn", handled=tuple(h for h in c.rec.handled if h not in awaiting),
                 awaiting=None, checkpoint_deadline=None, lacking_since=None)


Row = tuple[Callable[[Context], bool], Callable[[Context], Decision]]

# The transitions, first match wins: (what holds, what follows).
TRANSITIONS: tuple[Row, ...] = (
    (lambda c: c.rec.phase == GAVE_UP, lambda c: c.stay()),
    *fallback_moves.ROWS,  # spot <-> on-demand
    (lambda c: c.rec.phase == SUSPENDED, _wait_for_capacity),
    (lambda c: c.state.suspended, lambda c: c.stay()),  # suspended by someone else: not ours to resume
    (lambda c: bool(c.new_notices), lambda c: strategy_of(c.policy).on_notices(c, c.new_notices)),
    (lambda c: _checkpointing(c) and c.state.drained, _suspend_after_checkpoint),
    (lambda c: _checkpointing(c) and _withdrawn(c), _keep_running),
    (lambda c: _checkpointing(c) and c.now >= _deadline(c), _suspend_after_checkpoint),
    (_checkpointing, lambda c: c.stay(_deadline(c))),
    (lambda c: True, lambda c: strategy_of(c.policy).when_running(c)),
)


DEFAULT_SETTINGS = Settings()


def decide(state: JobState, now: datetime, settings: Settings = DEFAULT_SETTINGS, identity: str = "") -> Decision:
    """The decision for `state` at `now`: the first transition of TRANSITIONS whose condition
    holds, then the membership and the steps lost that follow from its record (module docstring),
    looking again when a held notice on the job's nodes becomes a departure."""
    context = Context(state, now, settings, identity)
    for holds, step in TRANSITIONS:
        if holds(context):
            return _completed(step(context), context)
    raise AssertionError("the last transition always holds")


def _completed(decision: Decision, c: Context) -> Decision:
    """`decision` with its membership, the steps lost and the release of held notices folded in."""
    state, policy = c.state, c.policy
    recheck = earliest(decision.recheck_at, state.release_at)
    if state.pods is None:
        return replace(decision, recheck_at=recheck)
    record = progress.with_steps_lost(decision.record, state.pods.every)
    shape = membership_plan.JobShape(
        elastic=policy.mode == ELASTIC, in_place=policy.in_place,
        start_at_min=policy.min_replicas if policy.start_at_min else 0, limit=policy.max_replicas,
        suspended={SUSPEND: True, RESUME: False, MOVE: False}.get(decision.action, state.suspended),
        replicas=decision.replicas or state.replicas)
    planned = membership_plan.plan(record, state.pods, shape, c.now, c.settings.join_settle)
    return replace(decision, record=planned.record, membership=planned.push,
                   recheck_at=earliest(recheck, planned.recheck_at))


def needs_capacity(state_policy: Policy, record: Record, replicas: int, suspended: bool) -> bool:
    """Whether `decide` would look at `free_slots` / `alt_slots` (so the controller can skip
    computing them)."""
    if record.phase == SUSPENDED or (state_policy.fallback is not None and record.capacity == fallback_rules.ON_DEMAND):
        return True
    return (state_policy.mode == ELASTIC and not suspended and record.phase == RUNNING
            and replicas < state_policy.max_replicas)
