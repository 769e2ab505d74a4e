"""Backfill: an elastic in-place job kept at max with on-demand replicas while spot is short, and
the on-demand replicas handed back for spot ones, one in-place swap at a time. Pure: counts,
clocks and the time in; one `BackfillStep` out.

Settings (`spotguard.io/fallback: on-demand` opts in; fallback.py parses `fallback-after` and
`return-after`; `spotguard.io/on-demand-max` caps the on-demand replicas, default max):

- **spot first**: a job below max gets a spot replica for every free spot slot, at once;
- **warm standby**: a member with a live notice (it is leaving, Kubernetes taking its pod away
  included), or one Kubernetes removed before the supervisor saw it leave (`departed`: its pod
  deleted, disruption.py), gets its replacement asked for at once: on spot only where spot
  capacity has been free for `return-after` (the same trust a swap-back needs), else on-demand
  (within `on-demand-max`), else on whatever spot is free. A departure is not a shortage of
  spot, which is what `fallback-after` waits out: the departure took its slot with it. A
  standby must be Ready before the leaving member's deadline, and spot capacity that has just come
  back is the likeliest to be taken again (reclaims come in bursts): one reclaimed during the
  standby's start-up leaves the job below max until a second replacement starts. An on-demand
  standby is handed back by the swap-back below once spot has proved itself;
- **backfill**: a job below max (not counting members that are leaving) for `fallback-after`
  (clock `below_max_since`) gets on-demand replicas up to max, at most `on-demand-max` of them;
- **swap-back**: while the job is at max with on-demand members, no change under way and spot
  capacity free for `return-after` (clock `spot_free_since`, reset whenever no spot slot is
  free), ONE spot replica is started to replace ONE on-demand member: once it is Ready, one
  membership lists it in place of the on-demand member (the joiner joins, the on-demand member
  leaves, in the same in-place change), so the job never drops below the size it had. The next
  swap waits for that one to finish.

Replicas asked for and not yet members (`starting_*`) count toward max, so a step never asks
twice for the same gap.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta


@dataclass(frozen=True)
class BackfillSettings:
    """A job's backfill settings: seconds, and the on-demand cap (None: max)."""

    max_replicas: int
    fallback_after: float
    return_after: float
    on_demand_max: int | None = None

    @property
    def on_demand_cap(self) -> int:
        return self.max_replicas if self.on_demand_max is None else min(self.on_demand_max, self.max_replicas)


@dataclass(frozen=True)
class BackfillView:
    """The job's replicas by capacity type, and the free slots of each type.

    `spot` / `on_demand`: members without a notice; `leaving`: members with a live notice (still
    training until they hand over); `departed`: members Kubernetes removed without notice (gone
    already: answered as leaving ones); `starting_*`: replicas asked for, not members yet (a
    swap's spot replica among them)."""

    spot: int
    on_demand: int
    leaving: int = 0
    departed: int = 0
    starting_spot: int = 0
    starting_on_demand: int = 0
    spot_free: int = 0
    on_demand_free: int = 0

    @property
    def staying(self) -> int:
        return self.spot + self.on_demand

    @property
    def starting(self) -> int:
        return self.starting_spot + self.starting_on_demand


@dataclass(frozen=True)
class BackfillClocks:
    """When the job went below max, and since when spot capacity is free (None: not now)."""

    below_max_since: datetime | None = None
    spot_free_since: datetime | None = None


@dataclass(frozen=True)
class BackfillStep:
    """What to ask for now: spot and on-demand replicas to add, whether to start one spot
    replica that replaces an on-demand member (a swap), the clocks to keep, why, when to look
    again even if nothing changes, and how many of the replicas added are warm standbys (the
    replacements of leaving members, on either capacity)."""

    add_spot: int = 0
    add_on_demand: int = 0
    swap: bool = False
    clocks: BackfillClocks = BackfillClocks()
    reason: str = ""
    recheck_at: datetime | None = None
    standby: int = 0

    @property
    def acts(self) -> bool:
        return bool(self.add_spot or self.add_on_demand or self.swap)


def plan(settings: BackfillSettings, view: BackfillView, clocks: BackfillClocks, now: datetime) -> BackfillStep:
    """The backfill step for `view` at `now` (module docstring)."""
    below = view.staying < settings.max_replicas
    clocks = replace(clocks, below_max_since=(clocks.below_max_since or now) if below else None,
                     spot_free_since=(clocks.spot_free_since or now) if view.spot_free > 0 else None)
    gap = max(0, settings.max_replicas - view.staying - view.starting)
    room = max(0, settings.on_demand_cap - view.on_demand - view.starting_on_demand)
    settled_at = None if clocks.spot_free_since is None \
        else clocks.spot_free_since + timedelta(seconds=settings.return_after)
    settled = settled_at is not None and now >= settled_at  # spot trusted: for a standby, and for a swap-back
    standby = min(gap, view.leaving + view.departed)
    whom = "a leaving member" if not view.departed else \
        ("a member that left (its pod is gone)" if not view.leaving else "members that leave or left")
    standby_spot = min(standby, view.spot_free if settled else 0)
    add_on_demand = min(standby - standby_spot, room, view.on_demand_free)
    add_spot = min(gap - add_on_demand, view.spot_free)  # the trusted standbys, then spot first for the rest
    standbys = min(standby, add_on_demand + add_spot)
    spot_standbys = standbys - add_on_demand
    reasons = [f"{spot_standbys} spot replica(s): warm standby for {whom}"] if spot_standbys else []
    if add_spot > spot_standbys:
        reasons.append(f"{add_spot - spot_standbys} spot replica(s) for free spot slots")
    if add_on_demand:
        why = f"spot free for less than return-after {settings.return_after:g}s" if view.spot_free \
            else "no spot slot free"
        reasons.append(f"{add_on_demand} on-demand replica(s): warm standby for {whom} ({why})")
    gap -= add_spot + add_on_demand
    recheck = None
    if gap:
        due = clocks.below_max_since + timedelta(seconds=settings.fallback_after) if clocks.below_max_since else now
        room -= add_on_demand
        if now >= due:
            more = min(gap, room, view.on_demand_free - add_on_demand)
            if more:
                add_on_demand += more
                reasons.append(f"{more} on-demand replica(s): below max {settings.max_replicas} for "
                               f"fallback-after {settings.fallback_after:g}s")
        elif room:
            recheck = due
    swap = False
    if not (add_spot or add_on_demand) and view.on_demand and not (view.leaving or view.departed or view.starting) \
            and view.staying >= settings.max_replicas and settled_at is not None:
        if settled:
            swap = True
            reasons.append(f"spot free for return-after {settings.return_after:g}s: one spot replica replaces "
                           "one on-demand member in place")
        else:
            recheck = settled_at if recheck is None else min(recheck, settled_at)
    return BackfillStep(add_spot, add_on_demand, swap, clocks, "; ".join(reasons), recheck, standbys)
