"""What `spotguard status` shows of one managed job, read from what the supervisor writes.

Pure (no I/O): `job_row(obj, adapter, now)` turns a Job / PyTorchJob as the API returns it into a
`JobRow`, from the job's spec and status, its policy annotations (policy.py), its decision record
(`spotguard.io/status`, record.py: phase, last decision, reclaims, cost totals, capacity) and its
`spotguard.io/steps-lost` annotation. Nothing is guessed: a value the job does not carry shows
as None ("-" in the table). A policy that does not validate shows as `invalid` with the
supervisor's own message; an unreadable record as phase `Unknown` with the reason.
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
from spotguard.supervisor.jobs import JobAdapter
from spotguard.supervisor.policy import PolicyError, parse_policy
from spotguard.supervisor.record import Record, RecordError, parse_record

INVALID = "invalid"
UNKNOWN = "Unknown"


@dataclass(frozen=True)
class JobRow:
    """One managed job, as the table and `-o json|yaml` show it."""

    namespace: str
    kind: str
    name: str
    policy: str  # elastic | fixed | invalid (+ "/in-place", "+fallback")
    phase: str  # the record's phase; Complete / Failed once the job finished
    replicas: int | None  # what the job asks for now (0 while suspended)
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
    last_decision: str  # the Event reason of the last decision ("" before any)
    last_reason: str
    last_message: str
    decided_at: datetime | None
    problem: str = ""  # why the policy or the record could not be read

    @property
    def node_hours(self) -> float | None:
        if self.spot_node_hours is None or self.on_demand_node_hours is None:
            return None
        return self.spot_node_hours + self.on_demand_node_hours

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["decided_at"] = None if self.decided_at is None else format_time(self.decided_at)
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


def _split(replicas: int | None, record: Record | None, raw: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(spot, on-demand) replicas: the record's own `split` ({"spot": n, "on-demand": n}, the
    replica pods the backfill placed on each) where it keeps one, else by its capacity."""
    if replicas is None:
        return None, None
    split = raw.get("split")
    if isinstance(split, dict):
        spot, on_demand = split.get("spot"), split.get(ON_DEMAND)
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (spot, on_demand)):
            return spot, on_demand
    if record is not None and record.capacity == ON_DEMAND:
        return 0, replicas
    return replicas, 0


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


def job_row(obj: Mapping[str, Any], adapter: JobAdapter) -> JobRow:
    """The row of one job (see the module docstring)."""
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    problem = ""
    try:
        policy = parse_policy(annotations, adapter.default_max(obj), adapter.default_min(obj))
        policy_text = policy.mode + ("/in-place" if policy.in_place else "") + ("+fallback" if policy.fallback else "")
        low, high = policy.min_replicas, policy.max_replicas
    except PolicyError as exc:
        policy_text, low, high, problem = INVALID, None, None, f"invalid policy annotation {exc}"
    status_text = annotations.get(names.ANN_STATUS)
    record: Record | None
    try:
        record = parse_record(status_text)
    except RecordError as exc:
        record, problem = None, problem or f"unreadable {names.ANN_STATUS}: {exc}"
    phase = _finished_phase(obj) or (record.phase if record is not None else UNKNOWN)
    try:
        replicas: int | None = 0 if adapter.suspended(obj) else adapter.replicas(obj)
    except (KeyError, TypeError, ValueError):
        replicas = None
    spot, on_demand = _split(replicas, record, _raw_record(status_text))
    spot_hours, od_hours, cost, savings = _cost(record)
    return JobRow(
        namespace=str(meta.get("namespace", "")), kind=adapter.kind, name=str(meta.get("name", "")),
        policy=policy_text, phase=phase, replicas=replicas, min_replicas=low, max_replicas=high,
        spot_replicas=spot, on_demand_replicas=on_demand,
        reclaims_survived=record.reclaims_survived if record is not None else 0,
        steps_lost=_steps_lost(annotations, record),
        spot_node_hours=spot_hours, on_demand_node_hours=od_hours, cost=cost, savings_ratio=savings,
        last_decision=record.event if record is not None else "",
        last_reason=record.reason if record is not None else "",
        last_message=record.message if record is not None else "",
        decided_at=record.decided_at if record is not None else None,
        problem=problem,
    )
