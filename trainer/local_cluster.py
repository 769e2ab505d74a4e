"""The dry-run's cluster: the local API (trainer/cluster/kube.py), its Job controller and
scheduler, the simulated nodes (trainer/nodes.py: metadata, agent, kubelet per instance), and
the supervisor itself: `spotguard.supervisor.controller.Controller` over the local API, as
`spotguard supervisor` runs it over a cluster's (informers, cache, work queue, reconciler,
policy, effects, in-place code, placer, cost keeper; nothing replaced); and the injector, as the
API's mutating webhook for pods (trainer/cluster/admission.py).

`Timings` are where this cluster is quicker than a real one, set the way an operator would set
them (the supervisor's `Settings` and `ControllerConfig`, the Job controller's failure backoff);
`describe()` says so in the dry-run's output.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from spotguard.kube.api import JOBS, PODS, NotFound
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.policy import Settings
from spotguard.trainer.cluster.admission import inject
from spotguard.trainer.cluster.jobs import JobController
from spotguard.trainer.cluster.kube import LocalKube
from spotguard.trainer.cluster.loop import Wakeup, keep_reconciling
from spotguard.trainer.cluster.scheduler import Scheduler
from spotguard.trainer.job_manifest import JOB, NAMESPACE
from spotguard.trainer.nodes import NodeServices, SimulatedNode, make_secret

log = logging.getLogger("spotguard.dryrun")


@dataclass(frozen=True)
class Timings:
    """See the module docstring (seconds; a cluster's defaults in the comments)."""

    scale_out_delay: float = 2.0  # spotguard supervisor --scale-out-delay (30)
    checkpoint_timeout: float = 60.0  # --checkpoint-timeout (120)
    join_settle: float = 5.0  # ControllerConfig.join_settle (10)
    resync: float = 5.0  # --resync (60)
    failure_backoff: float = 0.5  # the Job controller's pod failure backoff (10, doubling)
    reform_timeout: float = 10.0  # the Job's `spotguard launch --reform-timeout` (30)

    def describe(self) -> str:
        return (f"supervisor scale-out delay {self.scale_out_delay:g}s (cluster default 30s), checkpoint timeout "
                f"{self.checkpoint_timeout:g}s (120s), join settle {self.join_settle:g}s (10s), resync "
                f"{self.resync:g}s (60s); Job controller failure backoff {self.failure_backoff:g}s (10s, doubling)")


DEFAULT_TIMINGS = Timings()


class LocalCluster:
    """See the module docstring. `env`: variables every container of the run gets."""

    def __init__(self, run_dir: Path, cloud: str, timings: Timings = DEFAULT_TIMINGS,
                 env: dict[str, str] | None = None):
        self.run_dir, self.cloud, self.timings = run_dir, cloud, timings
        self.kube = LocalKube()
        self.kube.admit(PODS, inject)  # the injector's webhook
        self.services = NodeServices(self.kube, run_dir, run_dir / "report-secret", dict(env or {}))
        self.nodes: dict[str, SimulatedNode] = {}
        self.jobs = JobController(self.kube, timings.failure_backoff)
        self.scheduler = Scheduler(self.kube)
        self.supervisor = Controller(self.kube, ControllerConfig(
            identity="dry-run", namespace=NAMESPACE, resync=timings.resync, workers=2, join_settle=timings.join_settle,
            settings=Settings(checkpoint_timeout=timings.checkpoint_timeout, scale_out_delay=timings.scale_out_delay)))
        self._tasks: list[asyncio.Task] = []
        self._supervising = False

    async def start(self, spot: list[str], on_demand: list[str] = ()) -> None:
        """Starts the controllers, one instance per node, then the supervisor."""
        make_secret(self.services.report_secret)
        for name, sync in (("job controller", self.jobs.sync), ("scheduler", self.scheduler.sync)):
            wakeup = Wakeup()
            self.kube.subscribe(wakeup)
            self._tasks.append(asyncio.create_task(keep_reconciling(sync, wakeup, 1.0, name=name), name=name))
        for name in spot:
            self.nodes[name] = SimulatedNode(name, self.cloud, self.services)
        for name in on_demand:
            self.nodes[name] = SimulatedNode(name, self.cloud, self.services, capacity="on-demand")
        await asyncio.gather(*(node.start() for node in self.nodes.values()))
        await self.supervisor.start()
        self._supervising = True

    def submit(self, job: dict) -> None:
        self.kube.create(JOBS, NAMESPACE, job)

    def job(self) -> dict | None:
        try:
            return self.kube.get(JOBS, NAMESPACE, JOB)
        except NotFound:
            return None

    def pods(self) -> list[dict]:
        return self.kube.list(PODS, NAMESPACE)[0]

    async def stop(self, grace: float = 10.0) -> None:
        """The supervisor first (it must not answer the end of the run), then every node's pods
        (SIGTERM, `grace` seconds, then killed), then the controllers."""
        if self._supervising:
            self._supervising = False
            try:
                await self.supervisor.stop()
            except Exception:  # the nodes must stop whatever happened here
                log.exception("the supervisor did not stop cleanly")
        await asyncio.gather(*(node.stop(grace) for node in self.nodes.values()), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
