"""Where a backfill run's missing replica-seconds went: each joiner's start-up, its wait to be
admitted, and the time no joiner was on the way at all. Pure: records in, figures out.

Contract:
- `JoinerRecord`: one joiner process the dry-run started (a node restarted later is a new
  record): when it started, when it was first seen ready, and when it was admitted (the
  membership listing it was pushed) or stopped (its node reclaimed during its start-up, the job
  finished); `why` is the backfill step's reason that started it.
- `joiner_waits(records)`: start -> admitted seconds of the admitted joiners only (a stopped
  joiner never joined: its node's next joiner is its own record).
- `below_max(memberships, records, max_size, since, until)`: the replica-seconds the job ran
  below `max_size` between `since` and `until` (training's first start and its end), split at
  every instant over the missing replicas, in this order: a joiner starting up (started, not
  ready; `startup`, or `startup_stopped` for one that was stopped and never joined), a ready
  joiner not yet admitted (`admission`), and no joiner on the way (`uncovered`: waiting for
  fallback-after, or for capacity). Intervals are exact (piecewise constant), not sampled.
- `summarize_joiners(records)`: counts and medians a person reads.
The survivors' pauses of each change are not here: they come from the ranks' `resized` events
(`trainer.goodput.in_place_changes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from statistics import median


@dataclass
class JoinerRecord:
    node: str
    started: float
    why: str = ""
    ready: float | None = None
    admitted: float | None = None
    stopped: float | None = None

    @property
    def open(self) -> bool:
        return self.admitted is None and self.stopped is None


def joiner_waits(records: list[JoinerRecord]) -> list[float]:
    """Seconds from each admitted joiner's start to the membership that admitted it."""
    return [round(r.admitted - r.started, 3) for r in records if r.admitted is not None]


def _states(r: JoinerRecord, until: float) -> list[tuple[float, float, str]]:
    """(begin, end, state) spans of one joiner up to `until`."""
    end = r.admitted if r.admitted is not None else (r.stopped if r.stopped is not None else until)
    ready = r.ready if r.ready is not None and r.ready < end else end
    startup = "startup" if r.admitted is not None or r.stopped is None else "startup_stopped"
    spans = [(r.started, ready, startup)]
    if ready < end:
        spans.append((ready, end, "admission"))
    return spans


def below_max(memberships: list[tuple[float, int]], records: list[JoinerRecord], max_size: int,
              since: float, until: float) -> dict[str, float]:
    """See the module docstring. `memberships`: (time pushed, size), in push order."""
    spans = [s for r in records for s in _states(r, until)]
    cuts = sorted({since, until, *(t for t, _ in memberships if since < t < until),
                   *(t for b, e, _ in spans for t in (b, e) if since < t < until)})
    out = {"startup": 0.0, "startup_stopped": 0.0, "admission": 0.0, "uncovered": 0.0}
    for begin, end in pairwise(cuts):
        size = next((n for t, n in reversed(memberships) if t <= begin), max_size)
        missing = max(0, max_size - size)
        if not missing:
            continue
        for state in ("startup", "startup_stopped", "admission"):
            here = min(missing, sum(1 for b, e, s in spans if s == state and b <= begin and end <= e))
            out[state] += here * (end - begin)
            missing -= here
        out["uncovered"] += missing * (end - begin)
    return {k: round(v, 3) for k, v in out.items()}


def summarize_joiners(records: list[JoinerRecord]) -> dict[str, float | int | None]:
    """Admitted and stopped joiners, and the medians / maxima of their start-up and admission wait."""
    admitted = [r for r in records if r.admitted is not None]
    startups = [r.ready - r.started for r in admitted if r.ready is not None]
    admissions = [r.admitted - r.ready for r in admitted if r.ready is not None and r.admitted is not None]
    return {"admitted": len(admitted), "stopped": sum(r.stopped is not None for r in records),
            "startup_median_s": round(median(startups), 3) if startups else None,
            "startup_max_s": round(max(startups), 3) if startups else None,
            "admission_median_s": round(median(admissions), 3) if admissions else None,
            "admission_max_s": round(max(admissions), 3) if admissions else None}
