"""The types of a decision, shared by the policy, the fallback's moves and the strategies. Pure.

`JobState` is what the controller saw of one job (reduced from the API objects); `Decision` is
what `policy.decide` makes of it: an action (one of the constants below), the whole new record,
the membership to push to the job's pods, and when to look again. `Context` is one `decide`
call: the state, the time, the settings and the helpers every transition row uses (`act`,
`stay`, the notices not handled yet).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from collections.abc import Mapping

from spotguard.supervisor.fallback import Fallback
from spotguard.supervisor.job_notices import NoticeHit
from spotguard.supervisor.membership_plan import JobPods, MembershipPush
from spotguard.supervisor.record import Record
from spotguard.wire.notice_policy import HORIZON_SECONDS

__all__ = ["ELASTIC", "FIXED", "MOVE", "NONE", "RECORD", "RESUME", "SCALE", "SUSPEND", "Context", "Decision",
           "JobState", "NoticeHit", "Policy", "Settings", "decision_key", "earliest"]

ELASTIC, FIXED = "elastic", "fixed"

# Decision actions
NONE = "none"  # nothing to do (maybe recheck later)
SCALE = "scale"  # set the job's replicas
SUSPEND = "suspend"
RESUME = "resume"  # unsuspend at `replicas`
RECORD = "record"  # only the decision record changes (checkpoint wait, give-up)
MOVE = "move"  # switch the pod template's scheduling directives and unsuspend at `replicas`


@dataclass(frozen=True)
class Policy:
    """A job's validated policy. `max_wait` None means wait for capacity forever."""

    mode: str
    min_replicas: int
    max_replicas: int
    max_wait: float | None = None
    fallback: Fallback | None = None
    in_place: bool = False  # spotguard.io/in-place: membership changes in place (elastic only)
    on_demand_max: int | None = None  # spotguard.io/on-demand-max: backfill's cap (None: max)
    start_at_min: bool = False  # spotguard.io/start-at-min: train once min pods are Ready (in place only)
    horizon_seconds: float = HORIZON_SECONDS  # the Guard's, from the template (wire/injection.horizon_entry)


@dataclass(frozen=True)
class JobState:
    """What the controller saw of one job, reduced to what decisions depend on.

    `notices`: the live notices that read as departures (spotguard.wire.notice_policy) on the
    nodes of the job's replicas; `healthy_replicas`: active replica pods on nodes none of them
    departs; `release_at`: when the earliest notice held on the job's nodes becomes a departure
    (look again then); `free_slots`: further replicas of this job's pod shape that fit on healthy,
    schedulable nodes; `drained`: a replica exited 83/84 (the Guard drained after its checkpoint).
    `pods`: the job's pods and nodes as the membership reads them (membership_plan.py; None: no
    membership is planned, as in a model without pods). Fallback (fallback_moves.py):
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
    release_at: datetime | None = None
    pods: JobPods | None = None


@dataclass(frozen=True)
class Settings:
    """Supervisor-wide timings for decisions (seconds). `join_settle`: how long Ready joiners of
    an in-place job wait for replacements still starting (in_place.py `joiners_settled`)."""

    checkpoint_timeout: float = 120.0
    scale_out_delay: float = 30.0
    join_settle: float = 10.0


@dataclass(frozen=True)
class Decision:
    """One decision: the action, the record to write with it, and the Event that explains it.

    `replicas` is the target for SCALE/RESUME/MOVE; `directives` the scheduling directives per
    pod role that MOVE writes. `key` is the idempotency key (empty for NONE). `record` is the
    whole record to write, the membership's generation and hosts included (a NONE decision may
    carry a changed record too: a new membership, the steps lost, the join-settle clock).
    `membership`: what to push to the job's pods after the record is written (None: nothing).
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
    membership: MembershipPush | None = None

    @property
    def acts(self) -> bool:
        return self.action != NONE


def decision_key(*parts: object) -> str:
    """A short, deterministic idempotency key over the decision's identifying parts."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def earliest(*times: datetime | None) -> datetime | None:
    """The earliest of `times` that is not None (None when all are)."""
    return min((t for t in times if t is not None), default=None)


@dataclass(frozen=True)
class Context:
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

    @cached_property
    def previous(self) -> str:
        return self.rec.key or (self.rec.decided_at.isoformat() if self.rec.decided_at else "")

    @cached_property
    def new_notices(self) -> list[NoticeHit]:
        return sorted((n for n in self.state.notices if n.id not in self.rec.handled), key=lambda n: n.id)

    def act(self, action: str, *, event: str, message: str, key: str, replicas: int | None = None,
            event_type: str = "Normal", recheck_at: datetime | None = None,
            directives: Mapping[str, Mapping] | None = None, **changes) -> Decision:
        """A decision that acts: the record stamped with the time, this supervisor, the Event and
        the key, plus `changes`."""
        if replicas is not None:
            changes["replicas"] = replicas
        record = self.rec.with_(decided_at=self.now, decided_by=self.identity, event=event, message=message, key=key,
                                **changes)
        return Decision(action, record, replicas=replicas, reason=event, message=message, event_type=event_type,
                        key=key, recheck_at=recheck_at, directives=directives)

    def note(self, reason: str, message: str, recheck_at: datetime | None = None, **changes) -> Decision:
        """A RECORD that only moves a clock of the record (no Event, no key): `reason` and
        `message` say which, for the log."""
        return Decision(RECORD, self.rec.with_(**changes), reason=reason, message=message, recheck_at=recheck_at)

    def stay(self, recheck_at: datetime | None = None) -> Decision:
        return Decision(NONE, self.rec, recheck_at=recheck_at)
