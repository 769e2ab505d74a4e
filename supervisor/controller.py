"""The supervisor's control loop: watch Nodes, Pods and managed jobs; decide; act; explain.

The controller wires its parts and runs them:
- `ClusterCache` (cluster_cache.py): the informers' objects and indexes; every change names the
  jobs it may concern (a node's notice -> the jobs with pods there first; capacity freed -> the
  jobs waiting for it), which go into
- `WorkQueue` (work_queue.py): dedupe, delayed requeue, per-key backoff; a worker pool
  reconciles one job at a time per job through
- `Reconciler` (reconciler.py): job -> state -> `policy.decide` (action, record, membership) ->
  at most ONE conditional patch of the job, then
- `JobEffects` (effects.py): the job's one patch per pass, then the Event, the conditions and the
  membership (decided with the record by `policy.decide`) on the pods;
- `CostKeeper` (cost_keeper.py): cost totals observed, saved into the records, exported.
Only the leader acts (`elector.is_leader()` is checked before every write); followers keep warm
caches. Nothing but the API holds state: a restarted supervisor rebuilds everything from it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Iterable

from spotguard.kube.api import NODES, PODS, Kube
from spotguard.wire import names
from spotguard.supervisor.cluster_cache import ClusterCache, JobKey
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.cost_keeper import CostKeeper
from spotguard.supervisor.effects import JobEffects
from spotguard.supervisor.informer import Informer
from spotguard.supervisor.jobs import ADAPTERS, JobAdapter
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.policy import Decision, Settings
from spotguard.supervisor.reconciler import Reconciler
from spotguard.supervisor.sidecar_watch import MissingSidecars
from spotguard.supervisor.work_queue import WorkQueue

log = logging.getLogger(__name__)

__all__ = ["Controller", "ControllerConfig", "JobKey"]


@dataclass
class ControllerConfig:
    """How the controller runs. `namespace` None watches every namespace."""

    identity: str = "spotguard-supervisor"
    namespace: str | None = None
    settings: Settings = field(default_factory=Settings)
    resync: float = 60.0
    workers: int = 4
    membership_hosts: str = "node"
    cost_interval: float = 15.0
    cost_save_interval: float = 300.0  # how often the cost totals are saved into the decision record
    join_settle: float = 10.0  # in place: how long Ready joiners wait for replacements still starting (wins
    # over settings.join_settle)


class Controller:
    """See the module docstring. `elector` None means "always leader" (single replica, tests)."""

    def __init__(self, kube: Kube, config: ControllerConfig | None = None, *, elector=None,
                 metrics: SupervisorMetrics | None = None, ledger: CostLedger | None = None,
                 adapters: Iterable[JobAdapter] = ADAPTERS):
        self.kube = kube
        self.config = config or ControllerConfig()
        self.elector = elector
        self.metrics = metrics or SupervisorMetrics()
        self.ledger = ledger or CostLedger()
        self.adapters = {a.kind: a for a in adapters}
        cfg = self.config
        self.cache = ClusterCache(self.adapters)
        self.queue: WorkQueue[JobKey] = WorkQueue(self.reconcile, on_error=self.metrics.errors.inc)
        self.effects = JobEffects(kube, self.cache, identity=cfg.identity, metrics=self.metrics,
                                  is_leader=self.is_leader, requeue=self.queue.add)
        settings = replace(cfg.settings, join_settle=cfg.join_settle)
        self.reconciler = Reconciler(self.cache, self.effects, self.adapters, settings=settings,
                                     identity=cfg.identity, membership_hosts=cfg.membership_hosts, ledger=self.ledger,
                                     metrics=self.metrics, is_leader=self.is_leader, requeue=self.queue.add)
        self.costs = CostKeeper(self.ledger, self.cache, self.adapters, self.effects, self.metrics, self.is_leader)
        self.sidecars = MissingSidecars(self.metrics.pods_missing_sidecar, self.effects.create_event)
        self._informers: list[Informer] = []
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, sync_timeout: float = 30.0) -> None:
        """Starts informers and workers; returns once the caches hold a first full list."""
        loop = asyncio.get_running_loop()
        ns = self.config.namespace
        self._informers = [Informer(self.kube, NODES, None, self._on_node_event, loop),
                           Informer(self.kube, PODS, ns, self._on_pod_event, loop)]
        for adapter in self.adapters.values():
            self._informers.append(Informer(
                self.kube, adapter.resource, ns, self._job_handler(adapter), loop,
                label_selector={names.LABEL_MANAGED: "true"}, optional=adapter.optional))
        self.queue.open()  # keys from the first lists wait for the workers, which start once synced
        for informer in self._informers:
            informer.start()
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self._informers)), sync_timeout)
        self.queue.start(self.config.workers, name="supervisor-worker")
        self._tasks = [asyncio.create_task(self._resync_loop(), name="supervisor-resync"),
                       asyncio.create_task(self._cost_loop(), name="supervisor-cost")]
        self.metrics.registry.add_collector(self.costs.collect)
        self.enqueue_all()

    async def stop(self) -> None:
        await self.queue.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(i.stop) for i in self._informers))

    async def __aenter__(self) -> Controller:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def on_leadership(self, leader: bool) -> None:
        """Elector callback: a new leader reconciles everything at once."""
        self.metrics.leader.set(1 if leader else 0)
        if leader:
            self.enqueue_all()

    async def reconcile(self, key: JobKey) -> Decision | None:
        """One pass over one job (reconciler.py). Returns the decision taken."""
        return await self.reconciler.reconcile(key)

    def enqueue_all(self) -> None:
        self._enqueue(list(self.cache.jobs))

    def _enqueue(self, keys: Iterable[JobKey]) -> None:
        for key in keys:
            self.queue.add(key)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync)
            self.enqueue_all()
            await self.sidecars.warn()  # those the last leader, or a failed post, left unwarned

    async def _cost_loop(self) -> None:
        saved_at = 0.0
        while True:
            await asyncio.sleep(self.config.cost_interval)
            self.costs.observe()
            if time.monotonic() - saved_at >= self.config.cost_save_interval:
                saved_at = time.monotonic()
                await self.costs.save()

    # ---- informer events (event loop) -> cache -> queue ------------------------------------
    def _on_node_event(self, kind: str, payload: Any) -> None:
        keys = self.cache.apply_node(kind, payload)
        self.costs.observe(keys)  # a node's capacity type moved: count up to now at the old one
        self._enqueue(keys)

    def _on_pod_event(self, kind: str, payload: Any) -> None:
        self.sidecars.follow(kind, payload)  # a pod that asked for the sidecar and was admitted without it
        keys = self.cache.apply_pod(kind, payload)
        self.costs.observe(keys)  # the job's nodes may have moved: count up to now on the old ones
        self._enqueue(keys)

    def _job_handler(self, adapter: JobAdapter):
        def handle(kind: str, payload: Any) -> None:
            seen, deleted = self.cache.apply_job(adapter, kind, payload)
            if deleted is not None:
                self.costs.forget(deleted)
                self.effects.forget_invalid(deleted)
            for key in seen:
                self.costs.restore(key, self.cache.jobs[key])
                self.queue.add(key)
        return handle
