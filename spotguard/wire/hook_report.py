"""A rank's hook report to its sidecar (POST /v1/hooks, docs/protocols.md "Sidecar").

Wire form: `{"v": 1, "notice_id", "rank", "world_size", "step", "phase", "seconds"}` plus the
optional `steps_lost`; unknown extra fields are ignored. `HookReport.from_wire` rejects another
version or any bad field with `HookFormatError` naming it: `rank` below `world_size`, `phase`
one of `PHASES`, `seconds` a finite number >= 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spotguard.wire.fields import versioned_object, whole
from spotguard.wire.notice import MAX_NOTICE_ID

VERSION = 1
PHASES = ("checkpoint-durable", "drained", "failed")


class HookFormatError(ValueError):
    """A hook report body is invalid; the message names the field."""


@dataclass(frozen=True)
class HookReport:
    """One rank's report of one hook phase for one notice."""

    notice_id: str
    rank: int
    world_size: int
    step: int
    phase: str
    seconds: float
    steps_lost: int = 0

    @classmethod
    def from_wire(cls, obj: Any) -> HookReport:
        obj = versioned_object(obj, VERSION, HookFormatError, "body")
        notice_id = obj.get("notice_id")
        if not isinstance(notice_id, str) or not notice_id or len(notice_id) > MAX_NOTICE_ID:
            raise HookFormatError(f"notice_id: expected a non-empty string of at most {MAX_NOTICE_ID} characters")
        world_size = whole(obj, "world_size", 1, HookFormatError)
        rank = whole(obj, "rank", 0, HookFormatError)
        if rank >= world_size:
            raise HookFormatError(f"rank: {rank} is not below world_size {world_size}")
        step = whole(obj, "step", 0, HookFormatError)
        phase = obj.get("phase")
        if phase not in PHASES:
            raise HookFormatError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r:.40}")
        seconds = obj.get("seconds")
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
                or seconds < 0):
            raise HookFormatError(f"seconds: expected a finite number >= 0, got {seconds!r:.40}")
        steps_lost = whole(obj, "steps_lost", 0, HookFormatError) if "steps_lost" in obj else 0
        return cls(notice_id, rank, world_size, step, phase, float(seconds), steps_lost)

    def to_wire(self) -> dict[str, Any]:
        """The body with the protocol's required fields; `steps_lost` (and any other extra) is
        added by the sender, which must be able to resend without it."""
        return {"v": VERSION, "notice_id": self.notice_id, "rank": self.rank, "world_size": self.world_size,
                "step": self.step, "phase": self.phase, "seconds": self.seconds}
