"""The local dry-run: a real training job survives simulated reclaims on one machine, managed by
the supervisor's own code.

The run is a small cluster in this process (trainer/local_cluster.py): the local API, the Job
controller, the scheduler, per simulated node an instance (cloud metadata emulator, node agent
marking its Node, kubelet running its pods with their sidecars), and the supervisor,
`spotguard.supervisor.controller.Controller`, unchanged. The dry-run submits the Job users
deploy (trainer/job_manifest.py, after daemonset/examples/) and from then on only does what the
cloud and the user do: at each scenario event's time it tells a node's cloud (or GPU) what to
announce, kills a reclaimed node at its deadline, gives capacity back (trainer/injection.py).
Notices travel the real path: emulator -> agent -> Node mark -> supervisor (its decisions and
memberships), and agent -> sidecar -> Guard in the ranks -> agreed step -> checkpoint. Every
membership change, scale, suspend and resume is the supervisor's; every pod the Job
controller's; every process the kubelets'.

The scenario clock starts when the first rank logs `start`. The run ends when the Job is
complete, or when training finished (the first `finished` event's time) and no container that
started before that still runs (a joiner with nothing left to join is given FINISHED_GRACE
seconds; a pod the Job controller starts afterwards has nothing to train: the restart path's
Job completes when one index succeeded, trainer/job_manifest.py), or failed, or at the time
limit. A node whose deadline
came while its rank was still training is a problem in the report (its processes are killed,
every one: a worker of a reclaimed node never trains on). Whatever way `run()` ends, every
process it started is gone when it returns (the kubelets stop their pods; anything left is
found by the run's marker in its environment, trainer/reaper.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from spotguard.kube.api import PODS
from spotguard.trainer.cluster.pod_runner import LOG_DIR, container_log
from spotguard.trainer.cluster_log import PodLog, SupervisorLog
from spotguard.trainer.crashes import Crash, give_up
from spotguard.trainer.departures import departure_events, read_messages
from spotguard.trainer.events import EventTail, read_event_file, read_events
from spotguard.trainer.injection import Injector
from spotguard.trainer.job_manifest import JOB, Backfill, JobShape, job_manifest
from spotguard.trainer.local_cluster import DEFAULT_TIMINGS, LocalCluster, Timings
from spotguard.trainer.reaper import MARK_ENV, new_token, reap
from spotguard.trainer.report import GenerationRecord, InjectedEvent, MembershipRecord
from spotguard.trainer.rounds import rounds
from spotguard.trainer.run_report import assemble
from spotguard.trainer.scenario import Scenario, ScenarioEvent

log = logging.getLogger("spotguard.dryrun")

# The reference script of each framework the dry-run trains with (the others: spotguard.trainer.train).
FRAMEWORK_SCRIPTS = {"hf": "spotguard.trainer.train_hf", "accelerate": "spotguard.trainer.train_accelerate",
                     "lightning": "spotguard.trainer.train_lightning"}
FINISHED_GRACE = 15.0  # seconds a container may outlast the ranks that finished training
# A thread's header in a faulthandler dump (a C++ exception's "(most recent call first)" is not one).
STACK_DUMP = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", re.M)


class DryRun:
    """Runs one scenario end to end; `await run()` returns the report dict. `backfill`: the job
    falls back to the `on_demand` nodes (trainer/backfill_run.py)."""

    def __init__(self, scenario: Scenario, run_dir: Path, train_argv_extra: list[str] | None = None,
                 on_update: Callable[[DryRun], None] | None = None, time_limit: float = 600.0, *,
                 timings: Timings = DEFAULT_TIMINGS, backfill: Backfill | None = None, on_demand: tuple[str, ...] = ()):
        self.scenario, self.run_dir, self.on_update, self.time_limit = scenario, run_dir, on_update, time_limit
        self.train_argv_extra = train_argv_extra or []
        self.marker = new_token()  # in the environment of every process this run starts
        self.cluster = LocalCluster(run_dir, scenario.cloud, timings, env={MARK_ENV: self.marker})
        self.shape = JobShape(self._train_argv(), backfill=backfill, reform_timeout=timings.reform_timeout)
        self.on_demand = list(on_demand)
        self.injector = Injector(self.cluster.nodes)
        first = [] if scenario.start_at_min or backfill is not None else scenario.nodes
        self.supervisor_log, self.pod_log = SupervisorLog(JOB, first), PodLog()
        self.problems: list[str] = []
        self.started_at: float | None = None
        self.status = "starting"
        self._tail = EventTail(run_dir / "events")
        self._finished_seen: float | None = None
        self.crash: Crash | None = None  # the crash the run gave up at (trainer/crashes.py)

    @property
    def nodes(self):
        return self.cluster.nodes

    @property
    def injected(self) -> list[InjectedEvent]:
        return self.injector.injected

    @property
    def memberships(self) -> list[MembershipRecord]:
        """The memberships the supervisor pushed so far."""
        return self.supervisor_log.snapshot()[1]

    @property
    def world(self) -> list[str]:
        """The hosts of the supervisor's last membership, else the nodes whose pod runs."""
        memberships = self.memberships
        if memberships:
            return list(memberships[-1].hosts)
        return sorted(n.name for n in self.nodes.values() if n.busy())

    def events(self) -> list[dict]:
        """Every trainer event so far, in the order read (incrementally; not sorted)."""
        return self._tail.poll()

    def trainer_events(self) -> tuple[list[dict], list[GenerationRecord]]:
        """Every trainer event so far, `generation` the group it ran in, and the groups (rounds.py)."""
        return rounds(self._read_events(), self._container_starts())

    def _read_events(self) -> list[dict]:
        folder = self.run_dir / "events"
        return list(read_events(folder)) if folder.exists() else []

    def _container_starts(self) -> list[tuple[str, float]]:
        return [(p.node, p.started) for p in self.pod_log.snapshot() if p.node and p.started is not None]

    def report(self, finished_at: float) -> dict:
        decisions, memberships, _ = self.supervisor_log.snapshot()
        events = self._read_events()
        kinds = {i.notice_id: i.kind for i in self.injected if i.notice_id}
        messages = read_messages(self.run_dir / "pods", self.pod_log.snapshot())  # the ranks' termination messages
        events += departure_events(messages, events, kinds)
        return assemble(self.scenario, self.injected, events, self._container_starts(), memberships,
                        decisions,
                        started_at=self.started_at or finished_at, finished_at=finished_at, status=self.status,
                        not_reached=self.injector.carried_out, problems=self.problems,
                        timings=self.cluster.timings.describe(), crash=self.crash)

    def _train_argv(self) -> list[str]:
        s = self.scenario
        module = FRAMEWORK_SCRIPTS.get(s.framework, "spotguard.trainer.train")
        argv = ["-m", module, f"--framework={s.framework}", f"--steps={s.steps}", "--checkpoint-dir=/ckpt/train",
                f"--step-seconds={s.step_seconds}", "--snapshot-every=5", "--log-every=1",
                f"--batch-policy={'keep-global' if s.policy == 'fixed' else 'scale-lr'}",
                f"--base-world-size={s.workers}"]
        if s.checkpoint_every:
            argv.append(f"--checkpoint-every={s.checkpoint_every}")
        if s.long_step is not None:
            argv.append(f"--long-step={s.long_step[0]}:{s.long_step[1]:g}")
        if s.exit_on_drain:
            argv.append("--exit-on-drain")
        return argv + self.train_argv_extra

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        player: asyncio.Task | None = None
        try:
            self.status = "starting the cluster"
            await self._start()
            player = asyncio.create_task(self._play())
            self.status = "training"
            self.status = await self._until_done()
        finally:
            await self._stop_everything(player)
        return self.report(time.time())

    async def _start(self) -> None:
        kube = self.cluster.kube
        kube.admit(PODS, self.shape.ports.admit)
        kube.subscribe(self.supervisor_log)
        kube.subscribe(self.pod_log)
        await self.cluster.start(self.scenario.nodes, self.on_demand)
        self.cluster.submit(job_manifest(self.scenario, self.shape))

    async def _play(self) -> None:
        while self.started_at is None:
            starts = [e["t"] for e in self._tail.milestones() if e["event"] == "start"]
            if starts:
                self.started_at = min(starts)
            await asyncio.sleep(0.05)
        await self.injector.play(self.scenario.events, self.started_at)

    async def inject_now(self, *events: ScenarioEvent) -> list[InjectedEvent]:
        """Carries out `events` now, together (a test's event at the moment it wants)."""
        return await self.injector.inject_now(*events)

    async def _until_done(self) -> str:
        deadline = time.time() + self.time_limit
        while time.time() < deadline:
            await asyncio.sleep(0.1)
            for node, killed in await self.injector.due_deaths():
                self._check_deadline(node, killed)
            await self.on_tick()
            if self.on_update:
                self.on_update(self)
            outcome = self._outcome()
            if outcome is not None:
                return outcome
        return "time limit reached"

    async def on_tick(self) -> None:
        """Runs every tick of the run's loop (0.1 s): what a subclass adds to the cluster (the
        goodput bench's termination handler)."""

    def _outcome(self) -> str | None:
        conditions = {c.get("type"): c for c in ((self.cluster.job() or {}).get("status") or {}).get("conditions") or []
                      if c.get("status") == "True"}
        if "Complete" in conditions:
            return "finished"
        if "Failed" in conditions:
            return f"the Job failed: {conditions['Failed'].get('message', '')}"
        self.crash = give_up(self.pod_log.snapshot(), self._trained, self.run_dir / LOG_DIR,
                             job_trained=self.started_at is not None)
        if self.crash is not None:
            return self.crash.status
        finished = [e["t"] for e in self._tail.milestones() if e["event"] == "finished"]
        if not finished:
            return None
        self._finished_seen = self._finished_seen or time.time()
        # When the training finished, not when this loop saw it: a pod that started in between
        # (the loop is late under load) is no more busy than one that starts later.
        busy = [p for p in self.pod_log.snapshot() if p.started is not None and p.started < min(finished)
                and p.finished is None]  # pods started since have nothing left to train
        if not busy or time.time() - self._finished_seen > FINISHED_GRACE:
            return "finished"
        return None

    def _pod_events(self, pod: str) -> list[dict]:
        return [e for path in (self.run_dir / "events").glob(f"{pod}*.jsonl") for e in read_event_file(path)]

    def _trained(self, pod: str) -> bool:
        """Whether the trainer of `pod` started training (trainer/crashes.py)."""
        return any(e["event"] == "start" for e in self._pod_events(pod))

    def _check_deadline(self, node: str, killed: dict[str, list[int]]) -> None:
        """A node died at its deadline: a pod of it whose rank was still training missed it. A rank
        that logged its drain (or finished) did not; nor did one that wrote its departure (its
        termination message: trainer.departures) before the deadline and whose process was gone
        by then (its launcher may still have been exiting: torchrun's rendezvous shutdown). The
        problem names the pod's log when its processes wrote their threads' stacks there first."""
        deadline = max((i.deadline for i in self.injected if i.node == node and i.deadline is not None
                        and i.deadline <= time.time()), default=time.time())
        written = {m.pod: m.written_at for m in read_messages(self.run_dir / "pods", self.pod_log.snapshot())}
        for pod, pids in killed.items():
            mine = self._pod_events(pod)
            last = max((e for e in mine if e["event"] == "start"), key=lambda e: e["t"], default=None)
            if last is None or {e["event"] for e in mine} & {"drained", "finished"}:
                continue
            if last.get("pid") in (None, *pids) or written.get(pod, deadline) >= deadline:
                step = max((e.get("step", 0) for e in mine), default=0)
                dumped = self._stacks_dumped(pod)
                stacks = f"; its threads' stacks then: {container_log(pod)}" if dumped else ""
                self.problems.append(f"{node} reached its deadline with its rank still training (pod {pod}, step "
                                     f"{step}): every process of it was killed{stacks}")
                log.warning(self.problems[-1])

    def _stacks_dumped(self, pod: str) -> bool:
        """Whether the pod's log holds a stack dump (`reaper.dump_stacks` at its node's death)."""
        try:
            text = (self.run_dir / container_log(pod)).read_text(errors="replace")
        except OSError:
            return False
        return STACK_DUMP.search(text) is not None

    async def _stop_everything(self, player: asyncio.Task | None) -> None:
        """Ends every task and process this run started (shielded: it finishes even if the
        caller is cancelled again)."""
        async def stop() -> None:
            if player is not None:
                player.cancel()
                await asyncio.gather(player, return_exceptions=True)
            await self.injector.close()
            await self.cluster.stop(grace=10.0)
            left = await asyncio.to_thread(reap, self.marker, 5.0)
            if left:
                log.warning("ended %d processes the run left behind: %s", len(left), left)

        task = asyncio.ensure_future(stop())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise


def write_outputs(report: dict, run_dir: Path) -> tuple[Path, Path]:
    """Writes report.json and timeline.png into run_dir; returns their paths."""
    from spotguard.trainer.report import plot

    report_path = run_dir / "report.json"
    report_path.write_text(json.dumps(report, indent=2, default=str))
    plot_path = run_dir / "timeline.png"
    plot(report, str(plot_path))
    return report_path, plot_path
