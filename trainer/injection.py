"""The scenario's events, carried out on the dry-run's nodes at their times.

`Injector(nodes)`: `play(events, zero)` waits for each event's time (seconds after `zero`, the
first rank's start) and carries out the events of one instant together; `inject_now(*events)`
does it at once (a test's event at the moment it wants). What each kind does:
- `reclaim`, `maintenance`, `rebalance`: the node's cloud announces it (the emulator, read by the
  node's agent: the notice travels agent -> Node mark -> supervisor, and agent -> sidecar ->
  Guard); a reclaim's node dies at its deadline (`due_deaths`), as the cloud takes the VM then,
  or as soon as its notice is withdrawn before it (Azure: the agent approved the Preempt event
  once the checkpoint was durable, and the VM goes at once);
- `gpu-fault`: a fatal Xid through the node's fake NVML (its deadline is now; nothing kills the
  node: it is out of service until it is replaced);
- `cancel`: the node's scheduled maintenance is withdrawn;
- `capacity`: the cloud gives a node back: once no container of the old instance runs any more
  (its ranks left, or its deadline took it: the cloud returns capacity after the instance it took
  is gone), a new instance boots (a new VM: new agent, new Node); for a node no reclaim or fault
  took, it changes nothing.
Each injected event is an `InjectedEvent` (report.py) with the id the node's agent gave the
notice (learned from its live table), which ties the report's row to what the ranks did.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from spotguard.trainer.nodes import SimulatedNode
from spotguard.trainer.report import InjectedEvent
from spotguard.trainer.scenario import TAKING_KINDS, ScenarioEvent

log = logging.getLogger("spotguard.dryrun")
NOTICE_ID_WAIT = 30.0  # seconds the dry-run looks for an injected notice in its node's agent


class Injector:
    """See the module docstring."""

    def __init__(self, nodes: dict[str, SimulatedNode]):
        self.nodes = nodes
        self.injected: list[InjectedEvent] = []
        self.deadlines: dict[str, float] = {}  # node -> when its instance dies
        self.taken: set[str] = set()  # nodes a reclaim or a GPU fault took, until they come back
        self.carried_out = 0  # scenario events carried out so far
        self._trackers: list[asyncio.Task] = []

    async def play(self, events: tuple[ScenarioEvent, ...], zero: float) -> None:
        for at, group in itertools.groupby(events, key=lambda e: e.at):
            batch = list(group)
            delay = zero + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.inject_now(*batch)
            self.carried_out += len(batch)

    async def inject_now(self, *events: ScenarioEvent) -> list[InjectedEvent]:
        results = list(await asyncio.gather(*(self._inject_safely(e) for e in events)))
        self.injected.extend(results)
        return results

    async def due_deaths(self) -> list[tuple[str, dict[str, list[int]]]]:
        """Kills the nodes whose deadline passed or whose reclaim notice was withdrawn (module
        docstring): (node, {each pod whose container still ran: the PIDs killed})."""
        now, out = time.time(), []
        for name, deadline in list(self.deadlines.items()):
            if now >= deadline or self._withdrawn(name):
                del self.deadlines[name]
                out.append((name, await self.nodes[name].die()))
        return out

    def _withdrawn(self, node: str) -> bool:
        """The node's last reclaim notice was seen live and is not any more."""
        notice = next((i.notice_id for i in reversed(self.injected) if i.node == node and i.kind == "reclaim"), None)
        return notice is not None and all(n.id != notice for n in self.nodes[node].live_notices())

    async def close(self) -> None:
        for task in self._trackers:
            task.cancel()
        await asyncio.gather(*self._trackers, return_exceptions=True)

    async def _inject_safely(self, event: ScenarioEvent) -> InjectedEvent:
        try:
            return await self._inject(event)
        except Exception as exc:  # a failed injection is reported, the run goes on
            log.exception("could not inject %s on %s", event.kind, event.node)
            return InjectedEvent(event.kind, event.node, event.at, time.time(), note=f"failed: {exc}")

    async def _inject(self, event: ScenarioEvent) -> InjectedEvent:
        node = self.nodes[event.node]
        if event.kind == "capacity":
            return await self._give_back(event, node)
        now = time.time()
        if event.kind == "cancel":
            result = await node.cancel_maintenance()
            return InjectedEvent("cancel", event.node, event.at, now, served_at=result.served_at or now,
                                 emulator_id=result.emulator_id, note="maintenance canceled")
        known = {n.id for n in node.live_notices()}
        result = await node.inject(event.kind, event.lead)
        lead = None if result.deadline is None or result.served_at is None else result.deadline - result.served_at
        note = {"reclaim": f"{lead:.1f}s notice" if lead is not None else "notice",
                "gpu-fault": "fatal Xid 79"}.get(event.kind, "")
        if event.kind in TAKING_KINDS:
            self.taken.add(event.node)
        if event.kind == "reclaim" and result.deadline is not None:
            self.deadlines[event.node] = result.deadline
        # A GPU fault's notice is due at once, but nothing kills the node then: no deadline to meet.
        injected = InjectedEvent(event.kind, event.node, event.at, now, served_at=result.served_at,
                                 deadline=None if event.kind == "gpu-fault" else result.deadline,
                                 emulator_id=result.emulator_id, note=note)
        self._trackers.append(asyncio.create_task(self._learn_notice_id(injected, known)))
        return injected

    async def _give_back(self, event: ScenarioEvent, node: SimulatedNode) -> InjectedEvent:
        while event.node in self.taken and node.alive and node.busy():
            await asyncio.sleep(0.05)  # the instance it took must be gone first
        now = time.time()
        returned = event.node in self.taken or not node.alive
        if returned:
            self.taken.discard(event.node)
            self.deadlines.pop(event.node, None)
            await node.replace_instance()
        return InjectedEvent("capacity", event.node, event.at, now, served_at=time.time() if returned else now,
                             note="node available again" if returned else "already available", effective=returned)

    async def _learn_notice_id(self, injected: InjectedEvent, known: set[str]) -> None:
        """Records the id the node's agent gave the injected notice: the id the ranks log when
        they agree on it."""
        until = time.time() + NOTICE_ID_WAIT
        while time.time() < until:
            for notice in self.nodes[injected.node].live_notices():
                if notice.id not in known and notice.kind.value == injected.kind:
                    injected.notice_id = notice.id
                    return
            await asyncio.sleep(0.05)
        log.warning("the agent of %s never showed the %s notice injected at t=%.1fs", injected.node, injected.kind,
                    injected.at)
