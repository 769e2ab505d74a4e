"""The dry-run with on-demand backfill: the scenario's nodes are spot, and `on_demand_max` more
local nodes (`od-0`, `od-1`, ...) are on-demand: never reclaimed, registered from the start (the
supervisor counts free on-demand capacity from the Nodes it sees).

The Job is an in-place job with `spotguard.io/fallback: on-demand` (trainer/job_manifest.py):
its template admits both capacity types and carries the `spotguard.io/capacity` gate, it has a
spare replica and starts at min. From there every step is the supervisor's own backfill
(supervisor/backfill.py, placement.py, placer.py, in_place.py): it places the gated pods (spot
first; a warm standby for a member given a notice; on-demand once below max for
`fallback_after`; a spot joiner that takes an on-demand member's place once spot has been free
for `return_after`), and its memberships say `standby`, so a member with a notice trains on
while its replacement starts (the Guard's replacement hold).

For the goodput bench, from what the run recorded: `node_seconds()` (member-seconds per capacity
type, from the memberships), `joiners` (one `JoinerRecord` per pod the supervisor placed after
the first group: placed, Ready, admitted or stopped), `joiner_waits()` and `below_max()`
(trainer/backfill_timeline.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from spotguard.trainer.backfill_timeline import JoinerRecord, below_max, joiner_waits
from spotguard.trainer.dryrun import DryRun
from spotguard.trainer.job_manifest import Backfill
from spotguard.trainer.scenario import Scenario

log = logging.getLogger("spotguard.dryrun.backfill")

ON_DEMAND_PREFIX = "od-"


def on_demand(node: str) -> bool:
    return node.startswith(ON_DEMAND_PREFIX)


class BackfillDryRun(DryRun):
    """See the module docstring. Times are replay seconds."""

    def __init__(self, scenario: Scenario, run_dir: Path, train_argv_extra: list[str] | None = None, *,
                 fallback_after: float, return_after: float, on_demand_max: int | None = None, **kwargs: Any):
        if not scenario.in_place:
            raise ValueError("backfill needs an in-place job (elastic DDP/FSDP2)")
        settings = Backfill(fallback_after, return_after, on_demand_max)
        cap = scenario.workers if on_demand_max is None else min(on_demand_max, scenario.workers)
        super().__init__(scenario, run_dir, train_argv_extra, backfill=settings,
                         on_demand=tuple(f"{ON_DEMAND_PREFIX}{i}" for i in range(cap)), **kwargs)
        self.max_replicas = scenario.workers

    @property
    def joiners(self) -> list[JoinerRecord]:
        """One record per pod the supervisor placed after the first group formed, in placing order."""
        memberships = self.memberships
        if not memberships:
            return []
        first = memberships[0].t
        records = []
        for pod in sorted(self.pod_log.snapshot(), key=lambda p: p.placed or 0.0):
            if pod.placed is None or pod.placed <= first:
                continue
            record = JoinerRecord(pod.node or "", pod.placed, self._why(pod.placed), ready=pod.ready)
            record.admitted = next((m.t for m in memberships if m.t >= pod.placed and pod.node in m.hosts), None)
            if record.admitted is None and pod.finished is not None:
                record.stopped = pod.finished
            records.append(record)
        return records

    def _why(self, at: float) -> str:
        """The supervisor's backfill reason last recorded by `at`."""
        reasons = [d["backfill"] for d in self.supervisor_log.backfill_steps if d["t"] <= at + 0.5]
        return reasons[-1] if reasons else ""

    def joiner_waits(self) -> list[float]:
        """Seconds from each admitted joiner's placement to the membership that admitted it."""
        return joiner_waits(self.joiners)

    def below_max(self, since: float, until: float) -> dict[str, float]:
        """Replica-seconds below max between `since` and `until`, split by what the missing
        replicas were waiting for (`trainer.backfill_timeline.below_max`)."""
        return below_max([(m.t, len(m.hosts)) for m in self.memberships], self.joiners, self.max_replicas,
                         since, until)

    def node_seconds(self, since: float, until: float) -> dict[str, float]:
        """{"spot": s, "on-demand": s}: member-seconds of each capacity type between `since` and
        `until` (training's first start and its end), from the memberships pushed."""
        out = {"spot": 0.0, "on-demand": 0.0}
        memberships = self.memberships
        for here, nxt in zip(memberships, [*memberships[1:], None]):
            begin, end = max(here.t, since), min(nxt.t if nxt is not None else until, until)
            for host in here.hosts:
                out["on-demand" if on_demand(host) else "spot"] += max(0.0, end - begin)
        return {k: round(v, 3) for k, v in out.items()}
