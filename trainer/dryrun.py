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

In place (elastic DDP/FSDP2) the local supervisor pushes a membership generation for every
change it makes: when a rank left, when joiners are admitted (every joiner ready within a short
window, in one membership: `trainer.join_batch`; never one whose node got a notice or was
reclaimed during its start-up), and before every launch, naming the world it launches, so a
relaunched node never reads a stale membership that leaves it out (and joins instead of
starting). Each injected event is tied to what it caused by ids the report reads: the agent's
notice id, the membership generation that admitted a returning node, the generation drained to
scale out.

Whatever way `run()` ends (finished, time limit, an exception, cancelled by Ctrl-C), every
process it started is gone when it returns: launchers by their process group, and anything left
(a worker that outlived its launcher) by the marker in its environment (`trainer.reaper`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
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
from spotguard.trainer.join_batch import DEFAULT_WINDOW, JoinBatch
from spotguard.trainer.nodes import SimulatedNode, make_secret
from spotguard.trainer.reaper import MARK_ENV, new_token, reap
from spotguard.trainer.report import GenerationRecord, InjectedEvent, MembershipRecord, build_report
from spotguard.trainer.scenario import Scenario, ScenarioEvent
from spotguard.wire import names
from spotguard.wire.names import EXIT_PREEMPTED

log = logging.getLogger("spotguard.dryrun")

# The reference script of each framework the dry-run trains with (the others: spotguard.trainer.train).
FRAMEWORK_SCRIPTS = {"hf": "spotguard.trainer.train_hf", "lightning": "spotguard.trainer.train_lightning"}
MAX_CRASH_RELAUNCHES = 3
NOTICE_ID_WAIT = 30.0  # seconds the dry-run looks for an injected notice in its node's agent
LEAVING_KINDS = ("reclaim", "gpu-fault", "drain", "maintenance")  # notices a rank may leave in place for
FINISHED_GRACE = 15.0  # seconds a process may outlast the ranks that finished training
ENDING_GRACE = 40.0  # seconds the ranks of a failing generation get to exit by themselves (re-form timeout 10 s)


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
                 on_update: Callable[[DryRun], None] | None = None, time_limit: float = 600.0,
                 join_window: float = DEFAULT_WINDOW):
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
        self.memberships: list[MembershipRecord] = []
        self._joins = JoinBatch(join_window)  # joiners started and not yet admitted (in place)
        self.marker = new_token()  # in the environment of every process this run starts
        self._trackers: list[asyncio.Task] = []
        self._scenario_injected = 0
        self._finished_at: float | None = None  # in place: when the first rank finished training
        self._ending_since: float | None = None  # in place: a rank left without a notice; the generation ends
        self._left_unpushed = False  # ranks left in place; their membership waits for the others leaving
        self._noticed: set[str] = set()  # nodes whose rank got a notice it may leave for (until it has left)
        self._started_with: dict[int, int] = {}  # start at min: generation -> the size it started training at
        self.membership_standby = False  # pushed memberships say `standby` (backfill's warm standby)

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
                "--snapshot-every=5", "--log-every=1",
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
        at_min = self._starts_at_min()
        if self.in_place and not at_min:
            # Before any node starts: a node missing from the last membership would join it.
            await self._push_membership(world, "relaunch", launch=index)
        self._joins.clear()
        self._ending_since = self._finished_at = None
        self._noticed.clear()
        self._left_unpushed = False
        self.generation = Generation(index, launches, self._train_argv(), self.run_dir, rdzv_ports=self.rdzv_ports,
                                     min_world_size=self.scenario.min_workers, extra_env={MARK_ENV: self.marker},
                                     start_at_min=at_min)
        if at_min:
            for n in world:
                self.nodes[n].ready_file.unlink(missing_ok=True)
                self.generation.ready_files[n] = self.nodes[n].ready_file
        await self.generation.start()
        self.world = await self._start_at_min(self.generation, world) if at_min else list(world)
        self.generations.append(GenerationRecord(index, len(self.world), list(self.world),
                                                 self.generation.launched_at))
        log.info("generation %d: world size %d on %s", index, len(self.world), ", ".join(self.world))
        if self.started_at is None:
            self.started_at = self.generation.launched_at

    def _starts_at_min(self) -> bool:
        """Whether a launch starts at min: every launch of a start-at-min job, the first and each
        relaunch after a fallback or a crash (the supervisor starts every generation that way)."""
        return self.in_place and self.scenario.start_at_min

    async def _start_at_min(self, gen: Generation, world: list[str]) -> list[str]:
        """Start at min (what the supervisor does with `spotguard.io/start-at-min`): every node's
        workers wait (`spotguard launch --nnodes MIN:MAX`); once `min_workers` of them are ready,
        a membership marked `start` lists those, and the others are joiners admitted in place."""
        least = self.scenario.min_workers
        deadline = time.time() + self.time_limit
        while True:
            ready = [n for n in world if self.nodes[n].ready_file.exists()]
            if len(ready) >= least:
                break
            ended = [n for n in world if gen.running[n].process.returncode is not None]
            if ended or time.time() > deadline:
                raise RuntimeError(f"start at min: {least} ready nodes never came (ready: {ready}, ended: {ended})")
            await asyncio.sleep(0.05)
        first = ready[:least]
        await self._push_membership(first, "start", launch=gen.index, start=True)
        self._started_with[gen.index] = len(first)
        for n in world:
            if n not in first:
                self._joins.started(n, time.time())
        return first

    # ---- scenario events --------------------------------------------------------------------
    async def _training_started(self) -> float:
        """Waits for the first rank to log `start`: the scenario clock's zero."""
        while True:
            starts = [e["t"] for e in self._milestones() if e["event"] == "start"]
            if starts:
                return min(starts)
            await asyncio.sleep(0.05)

    async def _inject_events(self) -> None:
        """Carries out the scenario's events at their times; events of one instant together (the
        nodes that return at once are available at once, so one decision takes them all)."""
        self.started_at = await self._training_started()
        for at, group in itertools.groupby(self.scenario.events, key=lambda e: e.at):
            events = list(group)
            delay = self.started_at + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.inject_now(*events)
            self._scenario_injected += len(events)

    async def inject_now(self, *events: ScenarioEvent) -> list[InjectedEvent]:
        """Carries out `events` now, together (the scenario's events at their times; a test's
        event at the moment it wants); returns them as injected."""
        results = list(await asyncio.gather(*(self._inject_safely(e) for e in events)))
        returned = [inj.node for inj in results if inj.kind == "capacity" and inj.effective]
        for name in returned:
            self._deaths.pop(name, None)
            if name not in self.available:
                self.available.append(name)
        self.available.sort()
        self.injected.extend(results)
        return results

    async def _inject_safely(self, event: ScenarioEvent) -> InjectedEvent:
        try:
            return await self._inject(event)
        except Exception as exc:  # a failed injection is reported, the run goes on
            log.exception("could not inject %s on %s", event.kind, event.node)
            return InjectedEvent(event.kind, event.node, event.at, time.time(), note=f"failed: {exc}")

    async def _inject(self, event: ScenarioEvent) -> InjectedEvent:
        """Tells the node's cloud (or GPU) what to announce; a returning node is made a new
        instance (its availability is recorded by the caller, with the others of its instant)."""
        node = self.nodes[event.node]
        if event.kind == "capacity":
            await self._until_gone(event.node)
            now = time.time()
            returned = event.node not in self.available
            if returned:
                await node.replace_instance(self.secret)
            return InjectedEvent("capacity", event.node, event.at, now, served_at=time.time() if returned else now,
                                 note="node available again" if returned else "already available",
                                 effective=returned)
        now = time.time()
        if event.kind == "cancel":
            result = await node.cancel_maintenance()
            return InjectedEvent("cancel", event.node, event.at, now, served_at=result.served_at or now,
                                 emulator_id=result.emulator_id, note="maintenance canceled")
        known = {n.id for n in node.live_notices()}
        result = await node.inject(event.kind, event.lead)
        note = ""
        if event.kind in LEAVING_KINDS:
            self._noticed.add(event.node)
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
        injected = InjectedEvent(event.kind, event.node, event.at, now, served_at=result.served_at,
                                 deadline=deadline, emulator_id=result.emulator_id, note=note)
        self._trackers.append(asyncio.create_task(self._learn_notice_id(injected, known)))
        return injected

    async def _until_gone(self, node: str) -> None:
        """Waits until a reclaimed `node` no longer trains: its rank left (in place, or with the
        generation it drained), or its deadline took it. A capacity event timed inside the notice
        window would otherwise replace the node's agent and sidecar before its rank had seen the
        notice, and that rank would train on, never leaving (the cloud returns capacity after
        the instance it took is gone)."""
        while self._deaths.get(node) is not None and node in self.world:
            await asyncio.sleep(0.05)

    async def _learn_notice_id(self, injected: InjectedEvent, known: set[str]) -> None:
        """Records the id the node's agent gave the injected notice: the id the ranks log when
        they agree on it, which ties the report's row to what the ranks did."""
        until = time.time() + NOTICE_ID_WAIT
        while time.time() < until:
            for notice in self.nodes[injected.node].live_notices():
                if notice.id not in known and notice.kind.value == injected.kind:
                    injected.notice_id = notice.id
                    return
            await asyncio.sleep(0.05)
        log.warning("the agent of %s never showed the %s notice injected at t=%.1fs", injected.node, injected.kind,
                    injected.at)

    def _kill_dead_nodes(self) -> None:
        """A reclaimed node disappears at its deadline, whatever its rank (or joiner) was doing."""
        now = time.time()
        for node, deadline in list(self._deaths.items()):
            if deadline is not None and now >= deadline:
                del self._deaths[node]
                gen = self.generation
                if gen is None or gen.done:
                    continue
                if node in self._joins:
                    log.warning("%s reached its deadline during its joiner's start-up: the joiner dies with it", node)
                    self._joins.drop(node)
                    gen.signal_node(node, signal.SIGKILL)
                elif node in self.world:
                    log.warning("%s reached its deadline with its rank still running: the job loses it", node)
                    if self.in_place:
                        gen.signal_node(node, signal.SIGKILL)
                    else:
                        gen.signal_all(signal.SIGKILL)

    # ---- in place: the local supervisor pushes memberships, joiners are added -------------------
    async def _push_membership(self, hosts: list[str], cause: str, launch: int | None = None,
                               start: bool = False) -> None:
        """A new membership generation for every node's pod (the annotation -> sidecar -> Guard
        path); `start`: the first group of a start-at-min job."""
        assert self.rdzv_ports is not None
        self._left_unpushed = False  # every push names the current world
        self.membership_generation += 1
        membership = Membership(self.membership_generation, tuple(hosts), len(hosts),
                                store=f"127.0.0.1:{self.rdzv_ports[hosts[0]]}", start=start,
                                standby=self.membership_standby)
        for node in self.nodes.values():
            await asyncio.to_thread(node.push_membership, membership)
        self.memberships.append(MembershipRecord(
            self.membership_generation, list(hosts), time.time(), cause,
            launch if launch is not None else (self.generation.index if self.generation is not None else 0)))
        log.info("membership %d (%s): %s", self.membership_generation, cause, ", ".join(hosts))

    def _stop_joiners(self, gen: Generation, why: str) -> None:
        """Stops every joiner not admitted yet (SIGTERM: it has joined nothing, it just exits)."""
        for node in self._joins.clear():
            log.info("stopping the joiner on %s: %s", node, why)
            gen.signal_node(node, signal.SIGTERM)

    async def _follow_in_place(self, gen: Generation) -> None:
        """Departures (a rank left with 83 while others train on), joiners, and scale-outs."""
        ended = {n: gen.running[n].process.returncode for n in self.world if n in gen.running}
        if any(code == 0 for code in ended.values()):  # training finished: joiners have nothing to join
            self._stop_joiners(gen, "training finished")
            self._finished_at = self._finished_at or time.time()
            if time.time() - self._finished_at > FINISHED_GRACE:
                # e.g. a joiner admitted after the survivors' last step: it waits for a group that never forms
                log.warning("processes of generation %d still running %.0fs after training finished: stopping them",
                            gen.index, FINISHED_GRACE)
                gen.signal_all(signal.SIGTERM)
            return
        gone = [n for n, code in ended.items() if code is not None]
        unexpected = [n for n in gone if not self._leaving(n)]
        if unexpected or self._ending_since is not None:
            await self._end_generation(gen, unexpected, ended)
            return
        if gone and len(gone) < len(self.world):
            for node in gone:
                self.world.remove(node)
                self._noticed.discard(node)
                log.info("%s left in place (exit %s): %d workers train on", node,
                         gen.running[node].process.returncode, len(self.world))
            self.generations[-1].world_size = len(self.world)
            self._left_unpushed = True
        if self._left_unpushed and not any(self._leaving(n) for n in self.world):
            # Once the departures settle: a membership pushed while another noticed rank is still
            # leaving would list it, and reach the survivors after they dropped it themselves.
            self._left_unpushed = False
            await self._push_membership(self.world, "left")
        await self._admit_joiners(gen)
        await self._grow(gen)

    async def _grow(self, gen: Generation) -> None:
        """Starts joiners on free nodes when the supervisor scales out (the record also learns the notices)."""
        decision = self.supervisor.decide(self.world, self._hits(), self.available, drained=False)
        if decision.action == policy_mod.SCALE and decision.replicas:
            want = decision.replicas - len(self.world) - len(self._joins)
            for node in [n for n in self.available if n not in self.world and n not in self._joins
                         and not self._taken_away(n)][:max(0, want)]:
                ready = self.nodes[node].ready_file
                ready.unlink(missing_ok=True)
                self._joins.started(node, time.time())
                await gen.add_joiner(self._node_launch(gen.index, node), ready)
                log.info("scaling out in place: a joiner starts on %s", node)

    async def _end_generation(self, gen: Generation, unexpected: list[str], ended: dict[str, int | None]) -> None:
        """A rank left with no notice of its own: a change that fell back (its survivors save the
        agreed step and exit 83) or a crash. Nobody is admitted and no membership is pushed; the
        ranks get `ENDING_GRACE` seconds to exit by themselves, then they are stopped; the
        relaunch that follows pushes the membership of its own world."""
        now = time.time()
        if self._ending_since is None:
            self._ending_since = now
            log.warning("%s ended without a notice (exit %s): the generation ends and the job relaunches",
                        ", ".join(unexpected), ", ".join(str(ended[n]) for n in unexpected))
            self._stop_joiners(gen, "the generation is ending")
        elif now - self._ending_since > ENDING_GRACE:
            log.warning("ranks of generation %d still running %.0fs after it failed: stopping them", gen.index,
                        ENDING_GRACE)
            await gen.stop(grace=5.0)

    def _leaving(self, node: str) -> bool:
        """Whether a rank on `node` was expected to leave: its node got a notice a rank leaves in
        place for (the node may be back as a new instance before its old rank is gone), or it
        was reclaimed, or it shows such a notice now."""
        live = self.nodes[node].live_notices() if node in self.nodes else []
        return node in self._noticed or node not in self.available or any(n.kind.value in LEAVING_KINDS
                                                                          for n in live)

    def _taken_away(self, node: str) -> bool:
        """Whether `node` is gone or going: reclaimed, or with a live notice that takes it out."""
        return node not in self.available or bool(self._hits_on(node))

    async def _admit_joiners(self, gen: Generation) -> None:
        """Admits the ready joiners in one membership (`JoinBatch`); a joiner whose node was
        reclaimed (or got a notice) during its start-up is stopped, never admitted."""
        now = time.time()
        for node in list(self._joins.pending):
            joiner = gen.running.get(node)
            if joiner is None or joiner.process.returncode is not None:
                log.warning("the joiner on %s ended (exit %s) before joining", node,
                            None if joiner is None else joiner.process.returncode)
                self._joins.drop(node)
            elif self._taken_away(node):
                log.warning("%s was reclaimed during its joiner's start-up: the joiner is stopped, not admitted", node)
                self._joins.drop(node)
                gen.signal_node(node, signal.SIGTERM)
            elif self.nodes[node].ready_file.exists():
                self._joins.ready(node, now)
        due = self._joins.due(now)
        if due:
            await self._admit(due)

    async def _admit(self, due: list[str]) -> None:
        """Adds the ready joiners `due` to the world in one membership. It leaves out the members
        still leaving (a notice): listed, their ranks would shrink the group by their own notice
        first, drop the membership as written before they left, and the joiners, already waiting
        in its group, would time out."""
        self._joins.admitted(due)
        self.world.extend(due)
        self.generations[-1].nodes = sorted(set(self.generations[-1].nodes) | set(due))
        self.generations[-1].world_size = len(self.world)
        staying = [n for n in self.world if n in due or not self._leaving(n)]
        await self._push_membership(staying if len(staying) > len(due) else self.world, "admitted")
        for node in due:
            returned = [i for i in self.injected if i.kind == "capacity" and i.node == node and i.effective
                        and i.membership is None and i.rescaled is None]
            if returned:
                returned[-1].membership = self.membership_generation

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

    def _current_events(self, gen: Generation) -> list[dict]:
        """`gen`'s milestone events (all but step) from each node's current process (a node that
        left in place and joined again has an earlier process whose events no longer describe it)."""
        since = {n: r.started_at for n, r in gen.running.items()}
        return [e for e in self._milestones() if e.get("generation") == gen.index
                and e["t"] >= since.get(e.get("node"), 0.0) - 0.5]

    def _all_drained(self, gen: Generation) -> bool:
        """Whether every node still in `gen` logged `drained` with EXIT_PREEMPTED (checkpoint durable)."""
        drained = {e.get("node") for e in self._current_events(gen) if e["event"] == "drained"
                   and e.get("exit_code") == EXIT_PREEMPTED}
        members = self.world if self.in_place else [n.node for n in gen.nodes]
        return bool(members) and all(n in drained for n in members)

    def _training(self, gen: Generation) -> bool:
        """Whether every rank of `gen` has logged `start` (loaded its checkpoint, Guard armed)."""
        started = {e.get("rank") for e in self._milestones()
                   if e["event"] == "start" and e.get("generation") == gen.index}
        return len(started) >= self._started_with.get(gen.index, gen.world_size)

    def _events(self) -> list[dict]:
        """Every trainer event so far (incrementally read; not sorted)."""
        return self._tail.poll()

    def _milestones(self) -> list[dict]:
        """Every trainer event so far but `step` (incrementally read; not sorted): the loop's
        checks look only for start, drained and finished, and run every 0.1 s."""
        return self._tail.milestones()

    def _generation_outcome(self, gen: Generation) -> str:
        """finished, drained or crashed, from the ended generation's event logs (its last processes)."""
        mine = self._current_events(gen)
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
                    self._stop_joiners(gen, "the job drained")
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
                        for inj in self.injected:
                            if inj.kind == "capacity" and inj.effective and inj.rescaled is None \
                                    and inj.membership is None:
                                inj.rescaled = gen.index
                    continue
                if gen is not None:  # the generation just ended
                    record = self.generations[-1]
                    if record.ended_at is None:
                        record.ended_at = time.time()
                        record.exit_codes = {n: r.exit_code for n, r in gen.running.items()}
                        record.reason = self._generation_outcome(gen)
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
            await self._stop_everything(injector)
        finished_at = time.time()
        report = build_report(dataclasses.asdict(self.scenario), self.injected, self.generations,
                              read_events(self.run_dir / "events"),
                              self.started_at or finished_at, finished_at, self.scenario.steps,
                              memberships=self.memberships, in_place=self.in_place,
                              min_workers=self.scenario.min_workers)
        report["supervisor_decisions"] = [{**d, "t": round(d["t"] - (self.started_at or d["t"]), 3)}
                                          for d in self.supervisor.decisions]
        report["status"] = self.status
        report["not_reached"] = [{"at": e.at, "kind": e.kind, "node": e.node}
                                 for e in self.scenario.events[self._scenario_injected:]]
        allowed = self.scenario.allow_steps_lost
        if allowed and report["steps_lost"] <= allowed:
            report["problems"] = [p for p in report["problems"] if "steps lost" not in p]
            report["ok"] = not report["problems"]
        return report

    async def _stop_everything(self, injector: asyncio.Task | None) -> None:
        """Ends every task and process this run started (also when cancelled: shielded, it
        finishes even if the caller is cancelled again)."""
        async def stop() -> None:
            for task in [injector, *self._trackers]:
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in [injector, *self._trackers] if t is not None), return_exceptions=True)
            for old in [*self._retiring, self.generation]:
                if old is not None and not old.done:
                    try:
                        await old.stop(grace=10.0)
                    except Exception:  # the reaper below still ends its processes
                        log.exception("could not stop generation %d", old.index)
            left = await asyncio.to_thread(reap, self.marker, 5.0)
            if left:
                log.warning("ended %d processes the run left behind: %s", len(left), left)
            for node in self.nodes.values():
                await node.stop()

        task = asyncio.ensure_future(stop())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise

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
