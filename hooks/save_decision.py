"""The Guard's save decision at the agreed step: a fresh save, or the last in-memory snapshot.

Pure policy: no I/O, no torch. Each rank casts `vote(...)`; the ranks combine the votes with an
element-wise maximum (one all_reduce MAX; one rank alone uses its own vote) and every rank reads
the same `decide(combined)`:
- a rank's deadline is too short when the time left is below its estimate of a fresh save
  (from measured save times; 0 without a measurement) plus `margin_seconds`; no deadline is
  never too short;
- SNAPSHOT when any rank's deadline is too short and every rank holds a snapshot of the same step;
- NO_COMMON_SNAPSHOT (a fresh save anyway) when a deadline is too short but the ranks hold no
  common snapshot; FRESH otherwise.
"""
from __future__ import annotations

import enum
from typing import Sequence


class SaveChoice(enum.Enum):
    FRESH = "fresh"
    SNAPSHOT = "snapshot"
    NO_COMMON_SNAPSHOT = "no-common-snapshot"  # too short, but a fresh save is all there is


def vote(seconds_left: float | None, estimate_seconds: float | None, margin_seconds: float,
         snapshot_step: int | None) -> list[float]:
    """This rank's vote: [deadline too short, snapshot step, -snapshot step] (no snapshot: -1)."""
    too_short = seconds_left is not None and seconds_left < (estimate_seconds or 0.0) + margin_seconds
    snap = float(snapshot_step) if snapshot_step is not None else -1.0
    return [1.0 if too_short else 0.0, snap, -snap]


def decide(combined: Sequence[float]) -> SaveChoice:
    """The choice from the element-wise maximum of every rank's vote."""
    too_short, high, low = combined[0] > 0, combined[1], -combined[2]
    if not too_short:
        return SaveChoice.FRESH
    if low == high and low >= 0:
        return SaveChoice.SNAPSHOT
    return SaveChoice.NO_COMMON_SNAPSHOT
