"""Policies: the job's policy annotations, and the decision as a pure function of the job's state.

Nothing here talks to Kubernetes: `decide(state, now, settings)` maps what the controller saw
(the job's replicas, the live notices on its nodes, the capacity left, its decision record) to
one `Decision`: the first of `TRANSITIONS` (phase and state conditions, in order) that holds
decides, and what differs between the policies is a `Strategy` (`ElasticStrategy`,
`FixedStrategy`). The same state and time always give the same decision, which is what lets a
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
- elastic + `spotguard.io/in-place: "true"`: a notice only records itself (the noticed node's
  pod leaves by itself, its replacement joins; in_place.py), below min it suspends as elastic.
- `spotguard.io/fallback: on-demand`: moves between spot and on-demand capacity (fallback.py,
  consulted first).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from collections.abc import Callable, Mapping

from spotguard.config import ConfigError
from spotguard.supervisor import capacity_type
from spotguard.supervisor import fallback as fallback_rules
from spotguard.supervisor.in_place import wants_in_place
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
    in_place: bool = False  # spotguard.io/in-place: membership changes in place (elastic only)
    on_demand_max: int | None = None  # spotguard.io/on-demand-max: backfill's cap (None: max)
    start_at_min: bool = False  # spotguard.io/start-at-min: train once min pods are Ready (in place only)


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
    return Policy(mode, min_replicas, max_replicas, max_wait, fallback, in_place, on_demand_max, start_at_min)


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


@dataclass(frozen=True)
class _Context:
    """One `decide` call: the state, the clock and the derived values the transitions share."""

    state: JobState
    now: datetime
    settings: Settings
    identity: str

    @property
    def rec(self) -> Record:
        return self.state.record

    @property
    def policy(self) -> Policy:
        return self.state.policy

    @property
    def strategy(self) -> Strategy:
        return IN_PLACE if self.policy.in_place else STRATEGIES[self.policy.mode]

    @cached_property
    def previous(self) -> str:
        return self.rec.key or (self.rec.decided_at.isoformat() if self.rec.decided_at else "")

    @cached_property
    def move(self) -> Decision | None:
        return fallback_rules.decide_move(self.state, self.now, self.settings, self.identity)

    @cached_property
    def new_notices(self) -> list[NoticeHit]:
        return sorted((n for n in self.state.notices if n.id not in self.rec.handled), key=lambda n: n.id)

    def act(self, action: str, **kw) -> Decision:
        return _act(action, self.state, self.now, self.identity, **kw)

    def stay(self, recheck_at: datetime | None = None) -> Decision:
        return Decision(NONE, self.rec, recheck_at=recheck_at)


class Strategy:
    """What differs between the policies: how many replicas a resume needs and gets, what a new
    notice does, and what a running job does without one."""

    def resume_need(self, c: _Context) -> int:
        raise NotImplementedError

    def resume_target(self, c: _Context, need: int, slots: int) -> int:
        raise NotImplementedError

    def on_notices(self, c: _Context, new: list[NoticeHit]) -> Decision:
        raise NotImplementedError

    def when_running(self, c: _Context) -> Decision:
        return c.stay()


class ElasticStrategy(Strategy):
    """Scale to the replicas on unaffected nodes (suspend below min); scale back out toward max."""

    def resume_need(self, c: _Context) -> int:
        return c.policy.min_replicas

    def resume_target(self, c: _Context, need: int, slots: int) -> int:
        return min(c.policy.max_replicas, slots)

    def on_notices(self, c: _Context, new: list[NoticeHit]) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        ids, nodes, handled = _notice_facts(rec, new)
        target = min(state.healthy_replicas, policy.max_replicas)
        if target >= policy.min_replicas:
            return c.act(SCALE, event=names.EVENT_SCALED, replicas=target, key=decision_key("scale", *ids),
                         message=(f"notice {', '.join(ids)} on {nodes}: scaling from {state.replicas} to the {target} "
                                  f"replicas on unaffected nodes (min {policy.min_replicas})"),
                         phase=RUNNING, reason="NoticeScaledDown", handled=handled,
                         reclaims_survived=rec.reclaims_survived + 1)
        return c.act(SUSPEND, event=names.EVENT_SUSPENDED, key=decision_key("suspend", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: only {target} replicas on unaffected nodes, below "
                              f"min {policy.min_replicas}; suspending until capacity returns"),
                     phase=SUSPENDED, reason="BelowMin", handled=handled, replicas=state.replicas, waiting_since=c.now,
                     lacking_since=c.now)

    def when_running(self, c: _Context) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        desired = min(policy.max_replicas, state.healthy_replicas + state.free_slots)
        if desired <= state.replicas:
            return c.stay()
        ready_at = (rec.decided_at or c.now) + timedelta(seconds=c.settings.scale_out_delay)
        if rec.decided_at is not None and c.now < ready_at:
            return c.stay(ready_at)
        return c.act(SCALE, event=names.EVENT_SCALED, replicas=desired,
                     key=decision_key("scale-out", c.previous, desired),
                     message=(f"capacity returned: scaling out from {state.replicas} to {desired}"
                              f" (max {policy.max_replicas})"),
                     phase=RUNNING, reason="CapacityReturned")


class FixedStrategy(Strategy):
    """Wait for the checkpoint, suspend, resume at full size."""

    def resume_need(self, c: _Context) -> int:
        return c.rec.replicas or c.policy.max_replicas

    def resume_target(self, c: _Context, need: int, slots: int) -> int:
        return need

    def on_notices(self, c: _Context, new: list[NoticeHit]) -> Decision:
        rec, now = c.rec, c.now
        ids, nodes, handled = _notice_facts(rec, new)
        if rec.phase == CHECKPOINTING:
            return c.act(RECORD, event=names.EVENT_NOTED, key=decision_key("noted", *ids),
                         message=f"further notice on {nodes} while waiting for the checkpoint", handled=handled,
                         recheck_at=rec.checkpoint_deadline)
        deadlines = [n.deadline for n in new if n.deadline is not None]
        deadline = min(deadlines) if deadlines else now + timedelta(seconds=c.settings.checkpoint_timeout)
        return c.act(RECORD, event=names.EVENT_CHECKPOINTING, key=decision_key("checkpoint", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: waiting for the checkpoint (a replica exits "
                              f"{names.EXIT_PREEMPTED}/{names.EXIT_CHECKPOINT_FAILED}) until "
                              f"{deadline.isoformat()}, then suspending"),
                     recheck_at=deadline, phase=CHECKPOINTING, reason="NoticeReceived", handled=handled,
                     checkpoint_deadline=deadline, replicas=c.state.replicas, lacking_since=rec.lacking_since or now)


class InPlaceStrategy(ElasticStrategy):
    """Elastic, membership changed in place: a notice changes no replica count. The ranks on the
    noticed node hand over and exit 83 by themselves, the survivors re-form without waiting,
    and the Job controller (podFailurePolicy Ignore on 83) or the training operator replaces
    the pod, which joins once Ready (effects.ensure_membership). Below min: suspend, as elastic."""

    def on_notices(self, c: _Context, new: list[NoticeHit]) -> Decision:
        rec, policy, state = c.rec, c.policy, c.state
        survivors = min(state.healthy_replicas, policy.max_replicas)
        if survivors < policy.min_replicas:
            return super().on_notices(c, new)
        ids, nodes, handled = _notice_facts(rec, new)
        return c.act(RECORD, event=names.EVENT_LEAVING_IN_PLACE, key=decision_key("in-place", *ids),
                     message=(f"notice {', '.join(ids)} on {nodes}: the replicas there leave in place, the "
                              f"{survivors} on unaffected nodes keep training (min {policy.min_replicas}); "
                              f"replacements join when capacity allows"),
                     phase=RUNNING, reason="NoticeLeavingInPlace", handled=handled,
                     reclaims_survived=rec.reclaims_survived + 1)


STRATEGIES: dict[str, Strategy] = {ELASTIC: ElasticStrategy(), FIXED: FixedStrategy()}
IN_PLACE = InPlaceStrategy()


def _notice_facts(rec: Record, new: list[NoticeHit]) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(the new notices' ids, their nodes as text, the handled ids with them added)."""
    ids = tuple(n.id for n in new)
    return ids, ", ".join(sorted({n.node for n in new})), rec.handled_add(*ids)


def _fallback_recheck(c: _Context) -> datetime | None:
    return c.move.recheck_at if c.move is not None else None


def _wait_for_capacity(c: _Context) -> Decision:
    """A job we suspended: resume once its need fits, give up after max-wait, else wait."""
    rec, policy = c.rec, c.policy
    need = c.strategy.resume_need(c)
    slots = c.state.free_slots
    if slots >= need:
        target = c.strategy.resume_target(c, need, slots)
        return c.act(RESUME, event=names.EVENT_RESUMED, replicas=target, key=decision_key("resume", c.previous, target),
                     message=f"capacity for {target} replicas returned (needed {need}); resuming at {target}",
                     phase=RUNNING, reason="CapacityReturned", waiting_since=None, lacking_since=None)
    waiting_since = rec.waiting_since or rec.decided_at or c.now
    if policy.max_wait is None:
        return c.stay(_fallback_recheck(c))
    expiry = waiting_since + timedelta(seconds=policy.max_wait)
    if c.now >= expiry:
        return c.act(RECORD, event=names.EVENT_MAX_WAIT, event_type="Warning", key=decision_key("give-up", c.previous),
                     message=(f"waited {policy.max_wait:g}s (max-wait) without capacity for {need} replicas "
                              f"({slots} available): no longer waiting, the job stays suspended"),
                     phase=GAVE_UP, reason="MaxWaitExceeded")
    return c.stay(min(expiry, _fallback_recheck(c) or expiry))


def _await_checkpoint(c: _Context) -> Decision:
    """Checkpointing: suspend once a replica drained or the deadline passed, else look again then."""
    rec, state, now = c.rec, c.state, c.now
    deadline = rec.checkpoint_deadline or now
    if not (state.drained or now >= deadline):
        return c.stay(deadline)
    restore = rec.replicas or state.replicas
    return c.act(SUSPEND, event=names.EVENT_SUSPENDED, key=decision_key("suspend", c.previous),
                 message=("a replica drained after its checkpoint" if state.drained else
                          "the notice deadline passed") + f"; suspending, to resume at {restore} replicas",
                 phase=SUSPENDED, reason="Checkpointed" if state.drained else "DeadlineReached",
                 waiting_since=now, replicas=restore, reclaims_survived=rec.reclaims_survived + 1)


def _fallback_decides(c: _Context) -> bool:
    move = c.move
    return move is not None and (move.acts or move.recheck_at is None or c.rec.phase != SUSPENDED)


# The transitions, first match wins: (what holds, what follows). A step whose condition held
# never gives None (the fallback step's condition checks for its move); decide() enforces that.
TRANSITIONS: tuple[tuple[Callable[[_Context], bool], Callable[[_Context], Decision | None]], ...] = (
    (lambda c: c.rec.phase == GAVE_UP, lambda c: c.stay()),
    (_fallback_decides, lambda c: c.move),  # spot <-> on-demand (fallback.py)
    (lambda c: c.rec.phase == SUSPENDED, _wait_for_capacity),
    (lambda c: c.state.suspended, lambda c: c.stay()),  # suspended by someone else: not ours to resume
    (lambda c: bool(c.new_notices), lambda c: c.strategy.on_notices(c, c.new_notices)),
    (lambda c: c.rec.phase == CHECKPOINTING, _await_checkpoint),
    (lambda c: True, lambda c: c.strategy.when_running(c)),
)


def decide(state: JobState, now: datetime, settings: Settings = Settings(), identity: str = "") -> Decision:
    """The decision for `state` at `now`: the first transition of TRANSITIONS whose condition
    holds, with the job's policy strategy (see the module docstring for the policies)."""
    context = _Context(state, now, settings, identity)
    for holds, step in TRANSITIONS:
        if holds(context):
            decision = step(context)
            if decision is None:
                raise RuntimeError(f"transition {step!r} held but gave no decision for {state!r}")
            return decision
    raise AssertionError("the last transition always holds")


def needs_capacity(state_policy: Policy, record: Record, replicas: int, suspended: bool) -> bool:
    """Whether `decide` would look at `free_slots` / `alt_slots` (so the controller can skip
    computing them)."""
    if record.phase == SUSPENDED or (state_policy.fallback is not None and record.capacity == fallback_rules.ON_DEMAND):
        return True
    return (state_policy.mode == ELASTIC and not suspended and record.phase == RUNNING
            and replicas < state_policy.max_replicas)
