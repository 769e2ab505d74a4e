"""How `spotguard status` prints: a `kubectl get`-like table, `-o json|yaml`, and one job in detail
with its Events (a `kubectl describe`-like view). Pure: rows and Events in, text out."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from spotguard.wire.notice import NoticeFormatError, parse_time
from spotguard.supervisor.status_rows import JobRow

COLUMNS = ("NAMESPACE", "KIND", "NAME", "POLICY", "PHASE", "REPLICAS", "SPOT/OD", "RECLAIMS", "STEPS-LOST",
           "NODE-HOURS", "SAVINGS", "LAST-DECISION", "AGE")


def age(then: datetime | None, now: datetime) -> str:
    """kubectl's short age: 45s, 12m, 5h, 3d ("-" when unknown)."""
    if then is None:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def cells(row: JobRow, now: datetime) -> list[str]:
    replicas = f"{_dash(row.replicas)}/{_dash(row.min_replicas)}/{_dash(row.max_replicas)}"
    split = "-" if row.spot_replicas is None else f"{row.spot_replicas}/{row.on_demand_replicas}"
    return [row.namespace, row.kind, row.name, row.policy, row.phase, replicas, split, str(row.reclaims_survived),
            _dash(row.steps_lost), _dash(row.node_hours, "{:.2f}"),
            "-" if row.savings_ratio is None else f"{row.savings_ratio * 100:.0f}%",
            row.last_decision.removeprefix("Spotguard") or "-", age(row.decided_at, now)]


def table(rows: Sequence[JobRow], now: datetime) -> str:
    """Columns padded like `kubectl get` (three spaces apart); a line saying so when empty."""
    if not rows:
        return "No managed jobs found.\n"
    lines = [list(COLUMNS), *(cells(r, now) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "".join("   ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() + "\n" for line in lines)


def as_json(rows: Sequence[JobRow]) -> str:
    return json.dumps({"items": [r.to_dict() for r in rows]}, indent=2) + "\n"


def as_yaml(rows: Sequence[JobRow]) -> str:
    import yaml

    return yaml.safe_dump({"items": [r.to_dict() for r in rows]}, sort_keys=False)


def _event_time(event: Mapping[str, Any]) -> datetime | None:
    for name in ("lastTimestamp", "eventTime", "firstTimestamp"):
        value = event.get(name)
        if value:
            try:
                return parse_time(value, name)
            except NoticeFormatError:
                continue
    return None


def _since(then: datetime | None, now: datetime) -> str:
    return "-" if then is None else f"{age(then, now)} ago"


def _fields(row: JobRow, now: datetime) -> list[tuple[str, str]]:
    fields = [
        ("Name", row.name), ("Namespace", row.namespace), ("Kind", row.kind), ("Policy", row.policy),
        ("Phase", row.phase),
        ("Replicas", f"{_dash(row.replicas)} (min {_dash(row.min_replicas)}, max {_dash(row.max_replicas)})"),
    ]
    if row.generation is not None:
        fields.append(("Membership", f"generation {row.generation}: {', '.join(row.members) or '-'}"))
    fields += [
        ("Spot / on-demand", "-" if row.spot_replicas is None else f"{row.spot_replicas} / {row.on_demand_replicas}"),
        ("Reclaims survived", str(row.reclaims_survived)), ("Steps lost", _dash(row.steps_lost)),
        ("Node-hours", "-" if row.node_hours is None else
         f"{row.node_hours:.2f} (spot {row.spot_node_hours:.2f}, on-demand {row.on_demand_node_hours:.2f})"),
        ("Cost", _dash(row.cost, "${:.2f}")),
        ("Savings", "-" if row.savings_ratio is None else f"{row.savings_ratio * 100:.1f}%"),
        ("Last decision", f"{row.last_decision or '-'} {age(row.decided_at, now)} ago"
         if row.decided_at else "-"),
        ("Reason", row.last_reason or "-"), ("Message", row.last_message or "-"),
    ]
    if row.backfill_at is not None or row.below_max_since is not None or row.spot_idle_since is not None:
        placed = f"{row.backfill_event or '-'} {_since(row.backfill_at, now)}: {row.backfill or '-'}"
        fields += [("Last placement", placed if row.backfill_at is not None else "-"),
                   ("Below max since", _since(row.below_max_since, now)),
                   ("Spot free since", _since(row.spot_idle_since, now))]
    if row.problem:
        fields.append(("Problem", row.problem))
    return fields


def detail(row: JobRow, events: Iterable[Mapping[str, Any]], now: datetime) -> str:
    """One job: its fields, the last decision, the backfill's placement and clocks, then its
    Events oldest first."""
    fields = _fields(row, now)
    width = max(len(k) for k, _ in fields) + 2
    out = [f"{(k + ':').ljust(width)}{v}\n" for k, v in fields]
    ordered = sorted(events, key=lambda e: _event_time(e) or datetime.min.replace(tzinfo=now.tzinfo))
    out.append("Events:\n")
    if not ordered:
        out.append("  <none>\n")
        return "".join(out)
    lines = [["Type", "Reason", "Age", "From", "Message"]]
    for event in ordered:
        source = event.get("reportingComponent") or (event.get("source") or {}).get("component") or ""
        lines.append([str(event.get("type", "")), str(event.get("reason", "")), age(_event_time(event), now),
                      str(source), " ".join(str(event.get("message", "")).split())])
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    for line in lines:
        out.append("  " + "   ".join(c.ljust(w) for c, w in zip(line[:4], widths)) + "   " + line[4] + "\n")
    return "".join(out)
