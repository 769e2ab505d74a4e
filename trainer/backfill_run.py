"""The dry-run with on-demand backfill: the scenario's nodes are spot, and `on_demand_max` more
local nodes (`od-0`, `od-1`, ...) are on-demand: never reclaimed, always free when not in use,
started (metadata, agent, sidecar) when the first pod is placed on them.

The in-place job grows by the supervisor's backfill rules (`supervisor.backfill.plan`, the same
pure function the controller uses): spot joiners for free spot nodes, a warm-standby
replacement when a member gets a notice, on-demand joiners once the job has been below max for
`fallback_after` seconds, and, once a spot node has been free for `return_after`, one spot
joiner at a time that replaces one on-demand member in ONE membership (it joins, the on-demand
member leaves, the world size stays). A joiner Ready while a member with a notice still trains
(the Guard holds a notice until its deadline is within its horizon) takes that member's place
in one membership too, so the world never exceeds max. With `hold` (default) the memberships
say `standby`, so a member with a reclaim notice keeps training while its warm standby starts
(the Guard's replacement hold, `hooks/replacement_hold.py`) and leaves in the membership that
admits the standby, or at the latest safe moment before its deadline.

`node_seconds()` integrates the pushed memberships: the seconds each capacity type held a
member, for the on-demand share of node-hours.
"""
from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotguard.processes import free_port
from spotguard.supervisor.backfill import BackfillClocks, BackfillSettings, BackfillView, plan
from spotguard.trainer.backfill_timeline import JoinerRecord, below_max, joiner_waits
from spotguard.trainer.dryrun import LEAVING_KINDS, DryRun
from spotguard.trainer.launcher import Generation
from spotguard.trainer.nodes import SimulatedNode
from spotguard.trainer.report import InjectedEvent
from spotguard.trainer.scenario import Scenario, ScenarioEvent

log = logging.getLogger("spotguard.dryrun.backfill")

ON_DEMAND_PREFIX = "od-"


class BackfillDryRun(DryRun):
    """See the module docstring. Times are replay seconds."""

    def __init__(self, scenario: Scenario, run_dir: Path, train_argv_extra: list[str] | None = None, *,
                 fallback_after: float, return_after: float, on_demand_max: int | None = None, hold: bool = True,
                 **kwargs: Any):
        super().__init__(scenario, run_dir, train_argv_extra, **kwargs)
        self.membership_standby = hold
        if not self.in_place:
            raise ValueError("backfill needs an in-place job (elastic DDP/FSDP2)")
        self.settings = BackfillSettings(scenario.workers, fallback_after, return_after, on_demand_max)
        self.on_demand_nodes = [f"{ON_DEMAND_PREFIX}{i}" for i in range(self.settings.on_demand_cap)]
        assert self.rdzv_ports is not None
        self.rdzv_ports.update({n: free_port() for n in self.on_demand_nodes})
        self.clocks = BackfillClocks()
        self.swaps: dict[str, str] = {}  # spot joiner -> the on-demand member it replaces
        self.backfill_steps: list[dict] = []
        self.joiners: list[JoinerRecord] = []  # every joiner started, in start order
        self._standby_owed: set[str] = set()  # members given a notice since the last plan

    @staticmethod
    def on_demand(node: str) -> bool:
        return node.startswith(ON_DEMAND_PREFIX)

    async def _provision(self, name: str) -> None:
        """An on-demand node exists from the first pod placed on it (its metadata, agent and
        sidecar start then), as a cluster provisions one: idle ones would only take this
        machine's CPU from the training ranks, which a real cluster's nodes do not share."""
        if name not in self.nodes:
            node = SimulatedNode(name, self.scenario.cloud, self.run_dir)
            await node.start(self.secret)
            self.nodes[name] = node

    def _leaving(self, node: str) -> bool:
        if self.on_demand(node):
            return node in self._noticed or bool(self._hits_on(node))
        return super()._leaving(node)

    def _taken_away(self, node: str) -> bool:
        if self.on_demand(node):
            return bool(self._hits_on(node))
        return super()._taken_away(node)

    async def _inject(self, event: ScenarioEvent) -> InjectedEvent:
        """A notice on a member owes it a warm standby: the next plan counts that member as
        leaving even when its rank is already gone (a rank can leave within one tick of the run's
        loop, and the supervisor asks for the replacement on the notice, not on what it sees later)."""
        member = event.node in self.world
        injected = await super()._inject(event)
        if member and event.kind in LEAVING_KINDS:
            self._standby_owed.add(event.node)
        return injected

    def _view(self) -> BackfillView:
        leaving = {n for n in self.world if self._leaving(n)}
        gone_owed = self._standby_owed - set(self.world)  # noticed members whose ranks already left
        staying = [n for n in self.world if n not in leaving]
        starting = list(self._joins.pending)
        busy = set(self.world) | set(starting)
        return BackfillView(
            spot=sum(not self.on_demand(n) for n in staying), on_demand=sum(self.on_demand(n) for n in staying),
            leaving=len(leaving) + len(gone_owed), starting_spot=sum(not self.on_demand(n) for n in starting),
            starting_on_demand=sum(self.on_demand(n) for n in starting),
            spot_free=len(self._free_spot(busy)), on_demand_free=len(self._free_on_demand(busy)))

    def _free_spot(self, busy: set[str]) -> list[str]:
        return [n for n in self.available if n not in busy and not self._taken_away(n)]

    def _free_on_demand(self, busy: set[str]) -> list[str]:
        return [n for n in self.on_demand_nodes if n not in busy and not self._taken_away(n)
                and not self._still_exiting(n)]

    def _still_exiting(self, node: str) -> bool:
        gen = self.generation
        running = gen.running.get(node) if gen is not None else None
        return running is not None and running.process.returncode is None and node not in self.world

    async def _grow(self, gen: Generation) -> None:
        self.supervisor.decide(self.world, self._hits(), self.available, drained=False)  # records the notices
        step = plan(self.settings, self._view(), self.clocks, datetime.now(UTC))
        self._standby_owed.clear()  # this plan saw each notice
        self.clocks = step.clocks
        if not step.acts:
            return
        busy = set(self.world) | set(self._joins.pending)
        starts = self._free_spot(busy)[:step.add_spot + (1 if step.swap else 0)]
        starts += self._free_on_demand(busy)[:step.add_on_demand]
        if step.swap and starts:
            replaced = [n for n in self.world if self.on_demand(n)][-1]
            self.swaps[starts[0]] = replaced
        self.backfill_steps.append({"t": time.time(), "reason": step.reason, "start": list(starts),
                                    "swap": dict(self.swaps)})
        log.info("backfill: %s: joiners on %s", step.reason, ", ".join(starts))
        for node in starts:
            await self._start_joiner(gen, node, step.reason)

    async def _start_joiner(self, gen: Generation, node: str, why: str = "") -> None:
        now = time.time()  # the joiner's start-up includes its node's
        await self._provision(node)
        ready = self.nodes[node].ready_file
        ready.unlink(missing_ok=True)
        self._noticed.discard(node)  # a free node is a new instance: an old notice of its name is gone with it
        self._joins.started(node, now)
        self.joiners.append(JoinerRecord(node, now, why))
        await gen.add_joiner(self._node_launch(gen.index, node), ready)

    async def _admit_joiners(self, gen: Generation) -> None:
        for joiner in [j for j in self.swaps if j not in self._joins]:
            self.swaps.pop(joiner)  # a swap's joiner that ended or was stopped: the member stays
        await super()._admit_joiners(gen)
        self._close_stopped_joiners()

    def _open_joiner(self, node: str) -> JoinerRecord | None:
        return next((r for r in reversed(self.joiners) if r.node == node and r.open), None)

    def _close_stopped_joiners(self) -> None:
        """A joiner no longer pending and never admitted was stopped (its node reclaimed during its
        start-up, it ended, or the generation is ending)."""
        now = time.time()
        for record in self.joiners:
            if record.open and record.node not in self._joins:
                record.stopped = now
            elif record.open and record.ready is None:
                record.ready = self._joins.ready_at(record.node)

    async def _admit(self, due: list[str]) -> None:
        """Ready joiners join; each takes the place of the member it replaces in the same
        membership: the on-demand member of its swap, or a member with a notice still training
        (warm standby: the handover is one change), so the world never exceeds max."""
        leaving = [n for n in self.world if self._leaving(n)]
        for joiner in due:
            replaced = self.swaps.pop(joiner, None)
            if replaced is None and leaving:
                replaced = leaving.pop(0)
            if replaced is not None and replaced in self.world:
                log.info("%s joins in place of %s", joiner, replaced)
                self.world.remove(replaced)
                self._noticed.add(replaced)
        records = [(self._open_joiner(node), self._joins.ready_at(node)) for node in due]
        await super()._admit(due)
        for record, ready in records:
            if record is not None:
                record.ready = record.ready or ready
                record.admitted = self.memberships[-1].t

    def joiner_waits(self) -> list[float]:
        """Seconds from each admitted joiner's start to the membership that admitted it (a joiner
        stopped during its start-up is not counted; a later joiner on its node is its own)."""
        return joiner_waits(self.joiners)

    def below_max(self, since: float, until: float) -> dict[str, float]:
        """Replica-seconds below max between `since` and `until`, split by what the missing
        replicas were waiting for (`trainer.backfill_timeline.below_max`)."""
        return below_max([(m.t, len(m.hosts)) for m in self.memberships], self.joiners, self.settings.max_replicas,
                         since, until)

    def node_seconds(self, since: float, until: float) -> dict[str, float]:
        """{"spot": s, "on-demand": s}: member-seconds of each capacity type between `since` and
        `until` (training's first start and its end), from the memberships pushed."""
        out = {"spot": 0.0, "on-demand": 0.0}
        for here, nxt in zip(self.memberships, [*self.memberships[1:], None]):
            begin, end = max(here.t, since), min(nxt.t if nxt is not None else until, until)
            for host in here.hosts:
                out["on-demand" if self.on_demand(host) else "spot"] += max(0.0, end - begin)
        return {k: round(v, 3) for k, v in out.items()}
