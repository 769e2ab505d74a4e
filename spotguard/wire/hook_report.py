"""A rank's hook report to its sidecar (POST /v1/hooks, docs/protocols.md "Sidecar").

Wire form: `{"v": 1, "notice_id", "rank", "world_size", "step", "phase", "seconds"}` plus the
optional `steps_lost` and `durable_tier` (one of `DURABLE_TIERS`: "local" is on this node's disk
only and goes with it, "object" is in the object store, "disk" is the checkpoint directory of a
disk store); unknown extra fields are ignored, and a report without the optional ones (an older
Guard) reads as `steps_lost` 0 and no tier. A departing rank also says how its checkpoint was
made, each field optional (an older Guard sends none): `saved_by` (one of `SAVED_BY`: "boundary",
the ranks' agreed save at a step boundary; "watchdog", the deadline watchdog's persist of the held
snapshot; "nothing-new", nothing trained since the newest durable checkpoint; "none", neither saved: the
last-resort exit), `margin_seconds` (seconds left to the notice's deadline when the rank
left: a finite number, negative when it left after the deadline) and `snapshot_steps` (steps
trained after the saved step, whole >= 0). `HookReport.from_wire` rejects another version or
any bad field with `HookFormatError` naming it: `rank` below `world_size`, `phase` one of
`PHASES`, `seconds` a finite number >= 0.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotguard.wire.fields import versioned_object, whole
from spotguard.wire.notice import MAX_NOTICE_ID

VERSION = 1
PHASES = ("checkpoint-durable", "drained", "failed")
DURABLE_TIERS = ("local", "disk", "object")  # weakest first
SAVED_BY = ("boundary", "watchdog", "nothing-new", "none")


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
    durable_tier: str | None = None
    saved_by: str | None = None
    margin_seconds: float | None = None
    snapshot_steps: int | None = None

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
        seconds = _finite(obj, "seconds", ">= 0", lambda value: value >= 0)
        steps_lost = whole(obj, "steps_lost", 0, HookFormatError) if "steps_lost" in obj else 0
        saved_by = obj.get("saved_by")
        if saved_by is not None and saved_by not in SAVED_BY:
            raise HookFormatError(f"saved_by: expected one of {', '.join(SAVED_BY)}, got {saved_by!r:.40}")
        margin = _finite(obj, "margin_seconds") if obj.get("margin_seconds") is not None else None
        return cls(notice_id, rank, world_size, step, phase, seconds, steps_lost,
                   durable_tier_of(obj, HookFormatError), saved_by, margin,
                   whole(obj, "snapshot_steps", 0, HookFormatError, optional=True))

    def to_wire(self) -> dict[str, Any]:
        """The body with the protocol's required fields; `steps_lost`, `durable_tier`, `saved_by`,
        `margin_seconds`, `snapshot_steps` (and any other extra) are added by the sender, which
        must be able to resend without them."""
        return {"v": VERSION, "notice_id": self.notice_id, "rank": self.rank, "world_size": self.world_size,
                "step": self.step, "phase": self.phase, "seconds": self.seconds}


def _finite(obj: Any, name: str, bound: str = "", within: Callable[[float], bool] = lambda value: True) -> float:
    """`obj[name]` as a float: a finite number (not a bool) `within` its bound, else
    HookFormatError naming the field."""
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not within(value):
        raise HookFormatError(f"{name}: expected a finite number{' ' + bound if bound else ''}, got {value!r:.40}")
    return float(value)


def durable_tier_of(obj: Any, error: type[ValueError]) -> str | None:
    """The optional `durable_tier` of a body: one of DURABLE_TIERS, or None when absent."""
    tier = obj.get("durable_tier")
    if tier is not None and tier not in DURABLE_TIERS:
        raise error(f"durable_tier: expected one of {', '.join(DURABLE_TIERS)}, got {tier!r:.40}")
    return tier
