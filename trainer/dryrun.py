"""The local dry-run: a real training job survives simulated reclaims on one machine.

Pieces (all real except the GPU): per simulated node a metadata emulator, a node agent in
local mode and a sidecar (`trainer.nodes`); the training job as one torchrun per node per
generation (`trainer.launcher`); and a local supervisor that applies the supervisor's own
policy code (`supervisor.policy.decide`) to decide the next world size, suspend, or resume.

The scenario clock starts when the first generation launches. At each event's time the
dry-run tells the node's cloud (or GPU) what to announce. Notices travel the real path:
emulator -> agent source -> agent stream -> sidecar -> Guard in the rank -> agreed step ->
checkpoint -> exit 83. A node that is reclaimed dies at its deadline: if its rank is still
running then, the generation is killed and the report counts the steps lost.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Callable

from spotguard.supervisor import policy as policy_mod
from spotguard.supervisor.policy import JobState, NoticeHit, Policy, Settings, decide
from spotguard.supervisor.record import SUSPENDED, Record
from spotguard.trainer.events import EventTail, read_events
from spotguard.processes import free_port
from spotguard.trainer.launcher import Generation, NodeLaunch
from spotguard.wire.membership import Membership
from spotguard.trainer.nodes import SimulatedNode, make_secret
from spotguard.trainer.report import GenerationRecord, InjectedEvent, build_report
from spotguard.trainer.scenario import Scenario, ScenarioEvent
from spotguard.wire import names
from spotguard.wire.names import EXIT_PREEMPTED

log = logging.getLogger("spotguard.dryrun")

# The reference script of each framework the dry-run trains with (the others: spotguard.trainer.train).
FRAMEWORK_SCRIPTS = {"hf": "spotguard.trainer.train_hf", "lightning": "spotguard.trainer.train_lightning"}
MAX_CRASH_RELAUNCHES = 3


class LocalSupervisor:
    """The supervisor's decision function over the dry-run's local view of the job."""

    def __init__(self, scenario: Scenario, scale_out_delay: float = 2.0):
        self.policy = Policy(scenario.policy, min_replicas=scenario.min_workers if scenario.policy == "elastic"
                             else scenario.workers, max_replicas=scenario.workers)
        self.settings = Settings(checkpoint_timeout=60.0, scale_out_delay=scale_out_delay)
        self.record = Record(replicas=scenario.workers)
        self.decisions: list[dict] = []

    def decide(self, world: list[str], hits: list[NoticeHit], available: list[str],
               drained: bool) -> policy_mod.Decision:
        noticed = {h.node for h in hits}
        suspended = self.record.phase == SUSPENDED
        state = JobState(policy=self.policy, replicas=len(world), suspended=False, record=self.record,
                         notices=tuple(hits), healthy_replicas=len([n for n in world if n not in noticed]),
                         free_slots=len([n for n in available if n not in world and n not in noticed])
                         if not suspended else len([n for n in available if n not in noticed]),
                         drained=drained)
        decision = decide(state, datetime.now(UTC), self.settings, identity="dry-run")
        if decision.acts or decision.record != self.record:
            self.record = decision.record
        if decision.acts:
            self.decisions.append({"t": time.time(), "action": decision.action, "replicas": decision.replicas,
                                   "reason": decision.reason, "message": decision.message})
            log.info("supervisor: %s %s", decision.action, decision.message)
        return decision


class DryRun:
    """Runs one scenario end to end; `await run()` returns the report dict."""

    def __init__(self, scenario: Scenario, run_dir: Path, train_argv_extra: list[str] | None = None,
                 on_update: Callable[[DryRun], None] | None = None, time_limit: float = 600.0):
        self.scenario = scenario
        self.run_dir = run_dir
        self.train_argv_extra = train_argv_extra or []
        self.on_update = on_update
        self.time_limit = time_limit
        self.nodes: dict[str, SimulatedNode] = {}
        self.available: list[str] = list(scenario.nodes)
        self.world: list[str] = []
        self.generation: Generation | None = None
        self.generations: list[GenerationRecord] = []
        self.injected: list[InjectedEvent] = []
        self.supervisor = LocalSupervisor(scenario)
        self.started_at: float | None = None
        self.status = "starting"
        self._deaths: dict[str, float] = {}
        self._tail = EventTail(run_dir / "events")
        self._retiring: list[Generation] = []  # drained generations whose torchruns are still exiting
        self._rescale_requested = False
        self.in_place = scenario.in_place
        self.rdzv_ports = {n: free_port() for n in scenario.nodes} if self.in_place else None
        self.membership_generation = 0
        self._joining: dict[str, float] = {}  # node -> when its joiner was started (in place)

    # ---- the parts --------------------------------------------------------------------------
    async def _start_nodes(self) -> None:
        self.secret = make_secret(self.run_dir / "report-secret")
        for name in self.scenario.nodes:
            node = SimulatedNode(name, self.scenario.cloud, self.run_dir)
            await node.start(self.secret)
            self.nodes[name] = node

    def _train_argv(self) -> list[str]:
        s = self.scenario
        module = FRAMEWORK_SCRIPTS.get(s.framework, "spotguard.trainer.train")
        argv = ["-m", module, f"--framework={s.framework}", f"--steps={s.steps}",
                f"--checkpoint-dir={self.run_dir / 'checkpoints'}", f"--step-seconds={s.step_seconds}",
                "--snapshot-every=5", "--log-every=5",
                f"--batch-policy={'keep-global' if s.policy == 'fixed' else 'scale-lr'}",
                f"--base-world-size={s.workers}"]
        if s.checkpoint_every:
            argv.append(f"--checkpoint-every={s.checkpoint_every}")
        return argv + self.train_argv_extra

    def _node_launch(self, index: int, n: str) -> NodeLaunch:
        return NodeLaunch(n, {names.ENV_SIDECAR_URL: self.nodes[n].sidecar_url,
                              names.ENV_TOKEN_FILE: str(self.nodes[n].token_file),
                              names.ENV_GRACE_SECONDS: "30",
                              "SPOTGUARD_EVENT_LOG": str(self.run_dir / "events" / f"gen{index}-{n}.jsonl")})

    async def _launch(self, world: list[str]) -> None:
        index = len(self.generations)
        launches = [self._node_launch(index, n) for n in world]
        self.generation = Generation(index, launches, self._train_argv(), self.run_dir, rdzv_ports=self.rdzv_ports,
                                     min_world_size=self.scenario.min_workers)
        await self.generation.start()
        self.world = list(world)
        self.generations.append(GenerationRecord(index, len(world), list(world), self.generation.launched_at))
        log.info("generation %d: world size %d on %s", index, len(world), ", ".join(world))
        if self.started_at is None:
            self.started_at = self.generation.launched_at

    # ---- scenario events --------------------------------------------------------------------
    async def _training_started(self) -> float:
        """Waits for the first rank to log `start`: the scenario clock's zero."""
        while True:
            starts = [e["t"] for e in self._events() if e["event"] == "start"]
            if starts:
                return min(starts)
            await asyncio.sleep(0.05)

    async def _inject_events(self) -> None:
        self.started_at = await self._training_started()
        for event in self.scenario.events:
            delay = self.started_at + event.at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await self._inject(event)
            except Exception as exc:  # a failed injection is reported, the run goes on
                log.exception("could not inject %s on %s", event.kind, event.node)
                self.injected.append(
                    InjectedEvent(event.kind, event.node, event.at, time.time(), note=f"failed: {exc}"))

    async def _inject(self, event: ScenarioEvent) -> None:
        node = self.nodes[event.node]
        now = time.time()
        if event.kind == "capacity":
            returned = event.node not in self.available
            if returned:
                await node.replace_instance(self.secret)
                self._deaths.pop(event.node, None)
                self.available.append(event.node)
                self.available.sort()
            self.injected.append(InjectedEvent("capacity", event.node, event.at, now, served_at=now,
                                               note="node available again" if returned else "already available",
                                               effective=returned))
            return
        if event.kind == "cancel":
            result = await node.cancel_maintenance()
            self.injected.append(InjectedEvent("cancel", event.node, event.at, now, served_at=result.served_at or now,
                                               emulator_id=result.emulator_id, note="maintenance canceled"))
            return
        result = await node.inject(event.kind, event.lead)
        note = ""
        if event.kind in ("reclaim", "gpu-fault"):
            if event.node in self.available:
                self.available.remove(event.node)
            if event.kind == "reclaim":
                self._deaths[event.node] = result.deadline
                note = f"{event.lead or 'default'}s notice"
            else:
                note = "fatal Xid 79"
        # A GPU fault's notice is due at once, but nothing kills the node then: no deadline to meet.
        deadline = None if event.kind == "gpu-fault" else result.deadline
        self.injected.append(InjectedEvent(event.kind, event.node, event.at, now, served_at=result.served_at,
                                           deadline=deadline, emulator_id=result.emulator_id, note=note))

    def _kill_dead_nodes(self) -> None:
        """A reclaimed node disappears at its deadline, whatever its rank was doing."""
        now = time.time()
        for node, deadline in list(self._deaths.items()):
            if deadline is not None and now >= deadline:
                del self._deaths[node]
                if self.generation is not None and not self.generation.done and node in self.world:
                    log.warning("%s reached its deadline with its rank still running: the job loses it", node)
                    if self.in_place:
                        self.generation.signal_node(node, signal.SIGKILL)
                    else:
                        self.generation.signal_all(signal.SIGKILL)

    # ---- in place: the local supervisor pushes memberships, joiners are added -------------------
    async def _push_membership(self, hosts: list[str]) -> None:
        """A new membership generation for every node's pod (the annotation -> sidecar -> Guard path)."""
        assert self.rdzv_ports is not None
        self.membership_generation += 1
        membership = Membership(self.membership_generation, tuple(hosts), len(hosts),
                                store=f"127.0.0.1:{self.rdzv_ports[hosts[0]]}")
        for node in self.nodes.values():
            await asyncio.to_thread(node.push_membership, membership)
        log.info("membership %d: %s", self.membership_generation, ", ".join(hosts))

    async def _follow_in_place(self, gen: Generation) -> None:
        """Departures (a rank left with 83 while others train on), ready joiners, and scale-outs."""
        ended = {n: gen.running[n].process.returncode for n in self.world if n in gen.running}
        if any(code == 0 for code in ended.values()):  # training finished: joiners have nothing to join
            for node in list(self._joining):
                gen.signal_node(node, signal.SIGTERM)
            self._joining.clear()
            return
        gone = [n for n, code in ended.items() if code is not None]
        if gone and len(gone) < len(self.world):
            for node in gone:
                self.world.remove(node)
                log.info("%s left in place (exit %s): %d workers train on", node,
                         gen.running[node].process.returncode, len(self.world))
            self.generations[-1].world_size = len(self.world)
            await self._push_membership(self.world)
        for node in list(self._joining):
            joiner = gen.running.get(node)
            if joiner is not None and joiner.process.returncode is not None:
                log.warning("the joiner on %s ended (exit %s) before joining", node, joiner.process.returncode)
                del self._joining[node]
            elif self.nodes[node].ready_file.exists():
                del self._joining[node]
                self.world.append(node)
                self.generations[-1].nodes = list(self.world)
                self.generations[-1].world_size = len(self.world)
                await self._push_membership(self.world)
        decision = self.supervisor.decide(self.world, self._hits(), self.available, drained=False)
        if decision.action == policy_mod.SCALE and decision.replicas:
            want = decision.replicas - len(self.world) - len(self._joining)
            noticed = {h.node for n in self.available for h in self._hits_on(n)}
            for node in [n for n in self.available if n not in self.world and n not in self._joining
                         and n not in noticed][:max(0, want)]:
                ready = self.nodes[node].ready_file
                ready.unlink(missing_ok=True)
                self._joining[node] = time.time()
                await gen.add_joiner(self._node_launch(gen.index, node), ready)
                log.info("scaling out in place: a joiner starts on %s", node)

    # ---- the supervisor's view --------------------------------------------------------------
    def _hits(self) -> list[NoticeHit]:
        hits = []
        for name in self.world:
            if name not in self.nodes:
                continue
            for notice in self.nodes[name].live_notices():
                if notice.kind.value in ("reclaim", "gpu-fault", "drain") or (
                        notice.kind.value == "maintenance" and notice.seconds_left() is not None
                        and notice.seconds_left() < 60):
                    hits.append(NoticeHit(notice.id, name, notice.kind.value, notice.deadline))
        return hits

    def _all_drained(self, gen: Generation) -> bool:
        """Whether every node still in `gen` logged `drained` with EXIT_PREEMPTED (checkpoint durable)."""
        drained = {e.get("node") for e in self._events() if e["event"] == "drained"
                   and e.get("generation") == gen.index and e.get("exit_code") == EXIT_PREEMPTED}
        members = self.world if self.in_place else [n.node for n in gen.nodes]
        return bool(members) and all(n in drained for n in members)

    def _training(self, gen: Generation) -> bool:
        """Whether every rank of `gen` has logged `start` (loaded its checkpoint, Guard armed)."""
        started = {e.get("rank") for e in self._events() if e["event"] == "start" and e.get("generation") == gen.index}
        return len(started) >= gen.world_size

    def _events(self) -> list[dict]:
        """Every trainer event so far (incrementally read; not sorted)."""
        return self._tail.poll()

    def _generation_outcome(self) -> str:
        """finished, drained or crashed, from the ended generation's event logs."""
        index = self.generations[-1].index
        mine = [e for e in self._events() if e.get("generation") == index]
        if any(e["event"] == "finished" for e in mine):
            return "finished"
        if any(e["event"] == "drained" and e.get("exit_code") == EXIT_PREEMPTED for e in mine):
            return "drained"
        return "crashed"

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        injector = None
        crashes = 0
        try:
            self.status = "starting nodes"
            await self._start_nodes()
            await self._launch(self.available[: self.scenario.workers])
            injector = asyncio.create_task(self._inject_events())
            deadline = time.time() + self.time_limit
            self.status = "training"
            while time.time() < deadline:
                await asyncio.sleep(0.1)
                self._kill_dead_nodes()
                if self.on_update:
                    self.on_update(self)
                gen = self.generation
                running = gen is not None and not gen.done
                if running and self.in_place and self._training(gen) and not self._all_drained(gen):
                    await self._follow_in_place(gen)
                    continue
                if running and self._all_drained(gen):
                    # Every rank's checkpoint is durable and it has left the training loop; torchrun's
                    # own teardown (seconds) need not hold up the next generation.
                    self._retiring.append(gen)
                    running = False
                if running and self._rescale_requested:
                    continue
                if running and not self._training(gen):
                    continue  # ranks still starting up: nothing to decide until they train
                if running:
                    decision = self.supervisor.decide(self.world, self._hits(), self.available, drained=False)
                    if (decision.action == policy_mod.SCALE and decision.replicas
                            and decision.replicas > len(self.world)):
                        log.info("scaling out to %d: draining the running generation", decision.replicas)
                        self._rescale_requested = True
                        gen.signal_all(signal.SIGTERM)  # the Guard turns it into a consistent checkpoint
                    continue
                if gen is not None:  # the generation just ended
                    record = self.generations[-1]
                    if record.ended_at is None:
                        record.ended_at = time.time()
                        record.exit_codes = {n: r.exit_code for n, r in gen.running.items()}
                        record.reason = self._generation_outcome()
                        if record.reason == "finished":
                            self.status = "finished"
                            break
                        crashes = crashes + 1 if record.reason == "crashed" and not self._rescale_requested else 0
                        if crashes > MAX_CRASH_RELAUNCHES:
                            self.status = "gave up after repeated crashes"
                            break
                        self._rescale_requested = False
                        decision = self.supervisor.decide(self.world, self._hits(), self.available,
                                                          drained=record.reason == "drained")
                    self.generation = None
                target = self._next_world()
                if target:
                    await self._launch(target)
                else:
                    self.status = "suspended: waiting for capacity"
                    self.world = []
            else:
                self.status = "time limit reached"
        finally:
            if injector is not None:
                injector.cancel()
                await asyncio.gather(injector, return_exceptions=True)
            for old in [*self._retiring, self.generation]:
                if old is not None and not old.done:
                    await old.stop(grace=10.0)
            for node in self.nodes.values():
                await node.stop()
        finished_at = time.time()
        report = build_report(dataclasses.asdict(self.scenario), self.injected, self.generations,
                              read_events(self.run_dir / "events"),
                              self.started_at or finished_at, finished_at, self.scenario.steps)
        report["supervisor_decisions"] = [{**d, "t": round(d["t"] - (self.started_at or d["t"]), 3)}
                                          for d in self.supervisor.decisions]
        report["status"] = self.status
        injected = len(self.injected)
        report["not_reached"] = [{"at": e.at, "kind": e.kind, "node": e.node} for e in self.scenario.events[injected:]]
        allowed = self.scenario.allow_steps_lost
        if allowed and report["steps_lost"] <= allowed:
            report["problems"] = [p for p in report["problems"] if "steps lost" not in p]
            report["ok"] = not report["problems"]
        return report

    def _next_world(self) -> list[str]:
        """Who runs the next generation, by the supervisor's record (empty: stay suspended)."""
        rec = self.supervisor.record
        if rec.phase == SUSPENDED:
            decision = self.supervisor.decide([], [], self.available, drained=False)
            if decision.action != policy_mod.RESUME:
                return []
            rec = self.supervisor.record
        noticed = {h.node for n in self.available for h in self._hits_on(n)}
        healthy = [n for n in self.available if n not in noticed]
        target = rec.replicas or self.scenario.workers
        if self.scenario.policy == "elastic":
            target = max(self.scenario.min_workers, min(target, len(healthy)))
        if len(healthy) < (target if self.scenario.policy == "fixed" else self.scenario.min_workers):
            return []
        return healthy[:target]

    def _hits_on(self, name: str) -> list[NoticeHit]:
        node = self.nodes.get(name)
        if node is None:
            return []
        return [NoticeHit(n.id, name, n.kind.value, n.deadline) for n in node.live_notices()
                if n.kind.value in ("reclaim", "gpu-fault", "drain")]


def write_outputs(report: dict, run_dir: Path) -> tuple[Path, Path]:
    """Writes report.json and timeline.png into run_dir; returns their paths."""
    from spotguard.trainer.report import plot

    report_path = run_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=2, default=str))
    plot_path = run_dir / "timeline.png"
    plot(report, str(plot_path))
    return report_path, plot_path
