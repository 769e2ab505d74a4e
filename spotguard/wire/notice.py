"""The notice: one event that threatens a node's training work, and its versioned wire form.

Also the wire layer's shared time format (`format_time`/`parse_time`, RFC 3339 UTC).

Contract (stable across releases):
- `id` identifies one event on one instance: it is stable across polls and agent restarts on
  the same instance (VM), and a VM re-created under the same name gives new ids, so "already
  answered" never covers the new VM's notices. It is derived from the node, the instance (the
  cloud's instance id, the Node's uid, the boot for GPU faults; "" when unreadable, with the
  price `agent/sources/instance.py` states) and the cloud's own event id where one exists,
  otherwise the fields that identify the event (kind + deadline, or an ETag): see `notice_id`.
  Consumers dedupe by id.
- `kind` is one of `Kind`; `source` names the monitor that saw it (e.g. "aws.spot");
  `node` is the Kubernetes node (or host) name.
- `detected_at` and `deadline` are timezone-aware UTC datetimes; `deadline` is None when the
  cloud gives no time. `detail` holds the cloud's raw fields (JSON-compatible values only).
- `severity` is one of `Severity`: "act" (the default: a threat to act on) or "advisory"
  (information only: no consumer acts on it, waits for it or marks the node for it; e.g. a GPU
  warning). The wire form carries `severity` only when advisory, so a missing field reads as
  act and older readers and writers stay compatible.
- The wire form is a JSON object with `"v": WIRE_VERSION`. A reader rejects any other
  version, a missing or mistyped field, or a naive timestamp with `NoticeFormatError`; it never
  guesses. Unknown extra fields are ignored, so a newer writer can add fields.
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from datetime import datetime, UTC
from typing import Any
from collections.abc import Mapping

from spotguard.wire.fields import versioned_object

WIRE_VERSION = 1
MAX_NOTICE_ID = 512  # longest notice id a reader accepts where it names one (withdrawals, hook reports)


class Kind(enum.StrEnum):
    """What is about to happen to the node."""

    RECLAIM = "reclaim"  # spot/preemptible capacity taken back: the node goes away
    REBALANCE = "rebalance"  # elevated risk of a reclaim soon (AWS rebalance recommendation)
    MAINTENANCE = "maintenance"  # scheduled host maintenance, reboot or retirement
    GPU_FAULT = "gpu-fault"  # a GPU on the node failed or is failing
    DRAIN = "drain"  # the cluster is removing or cordoning the node (Karpenter, autoscaler, kubectl)


class Severity(enum.StrEnum):
    """Whether a notice asks for action or only informs."""

    ACT = "act"  # a threat: checkpoint, drain, mark the node
    ADVISORY = "advisory"  # information only: never a reason to act


class NoticeFormatError(ValueError):
    """A wire object is not a valid notice; the message says which field and why."""


def utc(dt: datetime) -> datetime:
    """Returns `dt` converted to UTC. Naive datetimes are rejected: their zone is unknowable."""
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError("naive datetime: a notice time must carry its zone")
    return dt.astimezone(UTC)


def now_utc() -> datetime:
    return datetime.now(UTC)


def format_time(dt: datetime) -> str:
    """RFC 3339 UTC with microseconds and a Z suffix, e.g. 2026-01-02T03:04:05.123456Z."""
    return utc(dt).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any, field_name: str = "time") -> datetime:
    """Parses an RFC 3339 / ISO 8601 timestamp that carries a zone; NoticeFormatError otherwise."""
    if not isinstance(value, str) or not value or len(value) > 64:
        raise NoticeFormatError(f"{field_name}: expected an ISO 8601 timestamp string, got {value!r:.80}")
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise NoticeFormatError(f"{field_name}: not an ISO 8601 timestamp: {value!r:.80}") from None
    if parsed.tzinfo is None:
        raise NoticeFormatError(f"{field_name}: timestamp has no zone: {value!r:.80}")
    return parsed.astimezone(UTC)


def notice_id(source: str, node: str, *identity: Any) -> str:
    """A stable id: `<source>:<hash>` over the node and the fields that identify the event.

    The same event seen again (next poll, restarted agent) gives the same id; two nodes never
    share one. The agent's sources pass the instance first in `identity`, then the cloud's own
    event id when it has one.
    """
    digest = hashlib.sha256(json.dumps([node, *map(str, identity)]).encode()).hexdigest()[:16]
    return f"{source}:{digest}"


def _json_safe(value: Any, path: str) -> Any:
    """Checks that `value` is plain JSON (no NaN, no non-string keys) and returns a copy."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NoticeFormatError(f"{path}: non-finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise NoticeFormatError(f"{path}: key {k!r} is not a string")
            out[k] = _json_safe(v, f"{path}.{k}")
        return out
    raise NoticeFormatError(f"{path}: {type(value).__name__} is not JSON")


@dataclass(frozen=True)
class Notice:
    """One event that threatens the node. Immutable; use `with_deadline` to move a deadline."""

    id: str
    kind: Kind
    source: str
    node: str
    detected_at: datetime
    deadline: datetime | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    severity: Severity = Severity.ACT

    def __post_init__(self) -> None:
        for name in ("id", "source", "node"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise NoticeFormatError(f"{name}: expected a non-empty string, got {value!r:.80}")
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise NoticeFormatError(f"kind: unknown kind {self.kind!r:.40}") from None
        try:
            object.__setattr__(self, "severity", Severity(self.severity))
        except (ValueError, TypeError):
            raise NoticeFormatError(f"severity: unknown severity {self.severity!r:.40}") from None
        for name in ("detected_at", "deadline"):
            value = getattr(self, name)
            if value is None and name == "deadline":
                continue
            if not isinstance(value, datetime):
                raise NoticeFormatError(f"{name}: expected a datetime, got {type(value).__name__}")
            try:
                object.__setattr__(self, name, utc(value))
            except ValueError as exc:
                raise NoticeFormatError(f"{name}: {exc}") from None
        object.__setattr__(self, "detail", _json_safe(self.detail, "detail"))

    @property
    def advisory(self) -> bool:
        """True for an advisory: information, never a reason to act."""
        return self.severity is Severity.ADVISORY

    def seconds_left(self, now: datetime | None = None) -> float | None:
        """Seconds until the deadline (negative once passed), or None when there is none."""
        if self.deadline is None:
            return None
        return (self.deadline - (now or now_utc())).total_seconds()

    def with_deadline(self, deadline: datetime | None) -> Notice:
        return replace(self, deadline=deadline)

    def same_event(self, other: Notice) -> bool:
        """True when `other` describes this event identically apart from when it was detected."""
        return (self.id, self.kind, self.source, self.node, self.deadline, self.detail, self.severity) == (
            other.id, other.kind, other.source, other.node, other.deadline, other.detail, other.severity)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "v": WIRE_VERSION,
            "id": self.id,
            "kind": self.kind.value,
            "source": self.source,
            "node": self.node,
            "detected_at": format_time(self.detected_at),
            "deadline": None if self.deadline is None else format_time(self.deadline),
            "detail": dict(self.detail),
        }
        if self.advisory:
            wire["severity"] = self.severity.value
        return wire

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_wire(cls, obj: Any) -> Notice:
        """Builds a notice from its wire object; NoticeFormatError names the first bad field."""
        obj = versioned_object(obj, WIRE_VERSION, NoticeFormatError, "notice", "wire version")
        for name in ("id", "kind", "source", "node", "detected_at"):
            if name not in obj:
                raise NoticeFormatError(f"{name}: missing")
        deadline = obj.get("deadline")
        detail = obj.get("detail", {})
        if not isinstance(detail, Mapping):
            raise NoticeFormatError("detail: expected a JSON object")
        return cls(
            id=obj["id"],
            kind=obj["kind"],
            source=obj["source"],
            node=obj["node"],
            detected_at=parse_time(obj["detected_at"], "detected_at"),
            deadline=None if deadline is None else parse_time(deadline, "deadline"),
            detail=detail,
            severity=obj.get("severity", Severity.ACT),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Notice:
        try:
            obj = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise NoticeFormatError(f"notice: not JSON ({exc})") from None
        return cls.from_wire(obj)
