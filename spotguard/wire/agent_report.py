"""A sidecar's report to its node agent (POST /v1/reports, docs/protocols.md "Agent").

Wire form: `{"v": 1, "notice_id", "pod", "namespace", "status": "checkpointed"|"failed",
"step"?, "hook_seconds"?: {name: seconds}, "steps_lost"?, "durable_tier"?}` (`durable_tier`: the
pod's weakest tier, as in `wire.hook_report`; written only when known, so an older agent, which
ignores unknown fields, reads the rest unchanged). `parse_report(obj)` rejects another
version or any bad field with `ReportFormatError` naming the first one; `Report.to_wire()`
writes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from spotguard.wire.fields import versioned_object, whole
from spotguard.wire.hook_report import durable_tier_of

VERSION = 1
STATUSES = ("checkpointed", "failed")


class ReportFormatError(ValueError):
    """The report body is invalid; the message names the field."""


@dataclass(frozen=True)
class Report:
    notice_id: str
    pod: str
    namespace: str
    status: str
    step: int | None = None
    hook_seconds: Mapping[str, float] = field(default_factory=dict)
    steps_lost: int | None = None
    durable_tier: str | None = None
    caller: str = ""
    received_at: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        body = {"v": VERSION, "notice_id": self.notice_id, "pod": self.pod, "namespace": self.namespace,
                "status": self.status, "step": self.step, "hook_seconds": dict(self.hook_seconds),
                "steps_lost": self.steps_lost}
        if self.durable_tier is not None:
            body["durable_tier"] = self.durable_tier
        return body


def _name(obj: Mapping, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > 253:
        raise ReportFormatError(f"{key}: expected a non-empty string of at most 253 characters")
    return value


def parse_report(obj: Any) -> Report:
    """Validates a report body; ReportFormatError names the first bad field."""
    obj = versioned_object(obj, VERSION, ReportFormatError, "body")
    status = obj.get("status")
    if status not in STATUSES:
        raise ReportFormatError(f"status: expected one of {', '.join(STATUSES)}")
    hooks = obj.get("hook_seconds", {})
    if not isinstance(hooks, Mapping) or len(hooks) > 32:
        raise ReportFormatError("hook_seconds: expected an object of at most 32 entries")
    for name, seconds in hooks.items():
        if (not isinstance(name, str) or len(name) > 64 or isinstance(seconds, bool)
                or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0):
            raise ReportFormatError(f"hook_seconds.{str(name)[:64]}: expected seconds >= 0")
    return Report(notice_id=_name(obj, "notice_id"), pod=_name(obj, "pod"), namespace=_name(obj, "namespace"),
                  status=status, step=whole(obj, "step", 0, ReportFormatError, optional=True), hook_seconds=dict(hooks),
                  steps_lost=whole(obj, "steps_lost", 0, ReportFormatError, optional=True),
                  durable_tier=durable_tier_of(obj, ReportFormatError))
