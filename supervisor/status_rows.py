"""What `spotguard status` shows of one managed job, read from what the supervisor writes.

Pure (no I/O): `job_row(obj, adapter)` turns a Job / PyTorchJob as the API returns it into a
`JobRow`, from the job's spec and status, its policy annotations (policy.py), its decision record
(`spotguard.io/status`, record.py: phase, last decision, membership, backfill, reclaims, cost
totals, capacity) and its `spotguard.io/steps-lost` annotation. Nothing is guessed: a value the
job does not carry shows as None ("-" in the table). A policy that does not validate shows as
`invalid` with the supervisor's own message (`problem`); an unreadable record as phase `Unknown`
with the reason.

What the row says:
- `replicas` (now): the replicas that train. In place: the size of the group the record's last
  membership names, 0 for a start-at-min job before its first group; otherwise the replicas the
  job's own status reports running (a Job's `status.ready`, a PyTorchJob's Worker `active`),
  never more than it asks for; 0 while suspended.
- `phase`: `Complete` / `Failed` once finished; the record's `Checkpointing`, `Suspended` or
  `GaveUp`; `Suspended` for a job suspended by someone else; `Starting` while not suspended and
  no replica trains yet (pods Pending, or a start-at-min job's group not formed); else `Running`.
- spot / on-demand: the record's `split` (the replica pods the backfill placed on each) where it
  keeps one, else the replicas now on the record's capacity once the supervisor decided
  something for the job; before that, unknown.
- the last decision: the later of the policy's decision (the record's `event`, `reason`,
  `message`, `decided_at`) and the backfill's last placement (`backfill_event`, `backfill`,
  `backfill_at`): both are decisions with an Event; each is kept in the row too.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any
from collections.abc import Mapping

from spotguard.wire import names
from spotguard.wire.notice import format_time
from spotguard.supervisor.capacity_type import ON_DEMAND
from spotguard.supervisor.decision import Policy
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.policy import PolicyError, parse_policy
from spotguard.supervisor.record import CHECKPOINTING, GAVE_UP, RUNNING, SUSPENDED, Record, RecordError, parse_record

INVALID = "invalid"
UNKNOWN = "Unknown"
STARTING = "Starting"  # not suspended, and no replica trains yet
BACKFILL_REASON = "Backfill"  # the reason of a placement's decision
TIMES = ("decided_at", "decision_at", "backfill_at", "below_max_since", "spot_idle_since")


@dataclass(frozen=True)
class JobRow:
    """One managed job, as the table and `-o json|yaml` show it (module docstring)."""

    namespace: str
    kind: str
    name: str
    policy: str  # elastic | fixed | invalid (+ "/in-place", "+fallback")
    phase: str
    replicas: int | None  # the replicas that train now
    min_replicas: int | None
    max_replicas: int | None
    spot_replicas: int | None
    on_demand_replicas: int | None
    reclaims_survived: int
    steps_lost: int | None
    spot_node_hours: float | None
    on_demand_node_hours: float | None
    cost: float | None
    savings_ratio: float | None  # 1 - cost / on-demand equivalent
    last_decision: str  # the Event reason of the last decision, placements included ("" before any)
    last_reason: str
    last_message: str
    decided_at: datetime | None  # when the last decision was made, placements included
    problem: str = ""  # why the policy or the record could not be read
    generation: int | None = None  # the membership last pushed (None: none)
    members: tuple[str, ...] = ()  # its hosts
    decision: str = ""  # the policy's last decision (its Event reason) and when
    decision_at: datetime | None = None
    backfill: str = ""  # the backfill's last placement and why
    backfill_event: str = ""
    backfill_at: datetime | None = None
    below_max_since: datetime | None = None  # the backfill's fallback-after clock
    spot_idle_since: datetime | None = None  # the backfill's return-after clock

    @property
    def node_hours(self) -> float | None:
        if self.spot_node_hours is None or self.on_demand_node_hours is None:
            return None
        return self.spot_node_hours + self.on_demand_node_hours

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in TIMES:
            value = getattr(self, name)
            out[name] = None if value is None else format_time(value)
        out["members"] = list(self.members)
        out["node_hours"] = self.node_hours
        return out


def _finished_phase(obj: Mapping[str, Any]) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Succeeded", "Failed"):
            return "Failed" if cond["type"] == "Failed" else "Complete"
    return None


def _steps_lost(annotations: Mapping[str, str], record: Record | None) -> int | None:
    raw = str(annotations.get(names.ANN_STEPS_LOST, "")).strip()
    if raw.isdigit():
        return int(raw)
    return record.steps_lost if record is not None and record.decided_at is not None else None


def _training(obj: Mapping[str, Any], adapter: JobAdapter, policy: Policy | None, record: Record | None) -> int | None:
    """The replicas that train now (module docstring); None when nothing says."""
    try:
        if adapter.suspended(obj):
            return 0
        asked = adapter.replicas(obj)
    except (KeyError, TypeError, ValueError):
        return None
    if policy is not None and policy.in_place and record is not None:
        if record.members:
            return len(record.members)
        if policy.start_at_min:
            return 0
    running = adapter.running_replicas(obj)
    return None if running is None else min(running, asked)


def _phase(obj: Mapping[str, Any], adapter: JobAdapter, record: Record | None, training: int | None) -> str:
    finished = _finished_phase(obj)
    if finished is not None:
        return finished
    if record is None:
        return UNKNOWN
    if record.decided_at is not None and record.phase in (CHECKPOINTING, SUSPENDED, GAVE_UP):
        return record.phase
    if adapter.suspended(obj):
        return SUSPENDED
    return STARTING if training == 0 else RUNNING


def _split(training: int | None, record: Record | None, raw: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(spot, on-demand) replicas: the record's own `split` ({"spot": n, "on-demand": n}, the
    replica pods the backfill placed on each) where it keeps one, else the replicas now on the
    record's capacity once the supervisor decided something (before: unknown)."""
    split = raw.get("split")
    if isinstance(split, dict):
        spot, on_demand = split.get("spot"), split.get(ON_DEMAND)
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (spot, on_demand)):
            return spot, on_demand
    if training is None or record is None or record.decided_at is None:
        return None, None
    if record.capacity == ON_DEMAND:
        return 0, training
    return training, 0


def _cost(record: Record | None) -> tuple[float | None, float | None, float | None, float | None]:
    totals = (record.cost if record is not None else None) or {}
    try:
        spot, od = float(totals["spot_hours"]), float(totals["on_demand_hours"])
        cost, equivalent = float(totals["cost"]), float(totals["on_demand_equivalent"])
    except (KeyError, TypeError, ValueError):
        return None, None, None, None
    savings = 1.0 - cost / equivalent if equivalent > 0 else None
    return spot, od, cost, savings


def _raw_record(text: str | None) -> Mapping[str, Any]:
    try:
        obj = json.loads(text or "{}")
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _last(record: Record | None) -> tuple[str, str, str, datetime | None]:
    """(Event reason, reason, message, when) of the later of the policy's decision and the
    backfill's placement."""
    if record is None:
        return "", "", "", None
    placed_at = record.backfill_at if record.backfill_event else None
    if placed_at is not None and (record.decided_at is None or placed_at > record.decided_at):
        return record.backfill_event, BACKFILL_REASON, record.backfill, placed_at
    return record.event, record.reason, record.message, record.decided_at


def job_row(obj: Mapping[str, Any], adapter: JobAdapter) -> JobRow:
    """The row of one job (see the module docstring)."""
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    problem = ""
    policy: Policy | None = None
    try:
        policy = parse_policy(annotations, adapter.default_max(obj), adapter.default_min(obj),
                              adapter.role_pod_specs(obj))
        policy_text = policy.mode + ("/in-place" if policy.in_place else "") + ("+fallback" if policy.fallback else "")
    except PolicyError as exc:
        policy_text, problem = INVALID, f"invalid policy {exc.setting} {exc}"
    status_text = annotations.get(names.ANN_STATUS)
    record: Record | None
    try:
        record = parse_record(status_text)
    except RecordError as exc:
        record, problem = None, problem or f"unreadable {names.ANN_STATUS}: {exc}"
    training = _training(obj, adapter, policy, record)
    spot, on_demand = _split(training, record, _raw_record(status_text))
    spot_hours, od_hours, cost, savings = _cost(record)
    event, reason, message, at = _last(record)
    rec = record or Record()
    return JobRow(
        namespace=str(meta.get("namespace", "")), kind=adapter.kind, name=str(meta.get("name", "")),
        policy=policy_text, phase=_phase(obj, adapter, record, training), replicas=training,
        min_replicas=policy.min_replicas if policy else None, max_replicas=policy.max_replicas if policy else None,
        spot_replicas=spot, on_demand_replicas=on_demand, reclaims_survived=rec.reclaims_survived,
        steps_lost=_steps_lost(annotations, record),
        spot_node_hours=spot_hours, on_demand_node_hours=od_hours, cost=cost, savings_ratio=savings,
        last_decision=event, last_reason=reason, last_message=message, decided_at=at, problem=problem,
        generation=rec.generation or None, members=rec.members, decision=rec.event, decision_at=rec.decided_at,
        backfill=rec.backfill, backfill_event=rec.backfill_event, backfill_at=rec.backfill_at,
        below_max_since=rec.below_max_since, spot_idle_since=rec.spot_idle_since,
    )
