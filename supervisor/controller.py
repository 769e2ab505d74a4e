"""The supervisor's control loop: watch Nodes, Pods and managed jobs; decide; act; explain.

Contract:
- caches are filled by informers (list + watch, one thread each); every change queues the jobs
  it may concern (a node's notice -> the jobs with pods there first; capacity freed -> the
  jobs waiting for it); a worker pool reconciles one job at a time per job;
- only the leader acts (`elector.is_leader()` is checked before every write); followers keep
  warm caches;
- reconcile(job): validate the policy (invalid -> a Warning Event naming the annotation, the job
  is not written to); reduce caches to a `JobState`; `policy.decide`; apply the decision as ONE
  merge patch of the job that carries the spec change, the new decision record (with the
  notices handled and the idempotency key) and `metadata.resourceVersion` as precondition
  (409 -> re-read, decide again); then, level-triggered and idempotent: the decision's Event
  (named after the key), the job's conditions, and the membership on the job's pods;
- nothing but the API holds state: a restarted supervisor rebuilds everything from it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from spotguard.agent.notice import Kind, Notice, NoticeFormatError, parse_time
from spotguard.backoff import Backoff
from spotguard.supervisor import capacity, conditions, membership, names, progress
from spotguard.supervisor.fallback import ON_DEMAND, on_demand_directives
from spotguard.supervisor.cost import CostLedger
from spotguard.supervisor.events import event_body
from spotguard.supervisor.informer import Informer
from spotguard.supervisor.jobs import ADAPTERS, JobAdapter
from spotguard.supervisor.jobs.base import merge
from spotguard.kube.api import EVENTS, NODES, PODS, ApiError, Conflict, Kube, NotFound
from spotguard.supervisor.metrics import SupervisorMetrics
from spotguard.supervisor.policy import (ELASTIC, MOVE, RESUME, SCALE, SUSPEND, Decision, JobState, NoticeHit,
                                         PolicyError, Settings, decide, decision_key, needs_capacity, parse_policy)
from spotguard.supervisor.record import CHECKPOINTING, RUNNING, Record, RecordError, parse_record

log = logging.getLogger(__name__)

JobKey = tuple[str, str, str]  # (kind, namespace, name)
PodKey = tuple[str, str]
NON_ACTING_KINDS = (Kind.REBALANCE.value,)  # a rebalance is a risk, not a departure


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


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _pod_signature(pod: Mapping[str, Any] | None) -> tuple:
    """What of a pod moves free capacity (not its annotations)."""
    if pod is None:
        return ()
    spec = pod.get("spec") or {}
    return (spec.get("nodeName"), (pod.get("status") or {}).get("phase"), _meta(pod).get("deletionTimestamp"),
            repr([c.get("resources") for c in spec.get("containers") or []]))


def _node_signature(node: Mapping[str, Any] | None) -> tuple:
    if node is None:
        return ()
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    return ((_meta(node).get("annotations") or {}).get(names.ANN_NOTICE), repr(spec.get("taints")),
            spec.get("unschedulable"), capacity.node_ready(node), repr(status.get("allocatable")),
            repr(_meta(node).get("labels")))


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
        self.nodes: dict[str, dict] = {}
        self.pods: dict[PodKey, dict] = {}
        self.jobs: dict[JobKey, dict] = {}
        self._pods_by_node: dict[str, set[PodKey]] = {}
        self._pods_by_owner: dict[JobKey, set[PodKey]] = {}
        self._pod_owner: dict[PodKey, JobKey] = {}
        self._pod_node: dict[PodKey, str] = {}
        self._notice_cache: dict[str, Notice | None] = {}
        self._notice_seen_at: dict[str, float] = {}
        self._queue: asyncio.Queue[JobKey] | None = None
        self._queued: set[JobKey] = set()
        self._busy: set[JobKey] = set()
        self._dirty: set[JobKey] = set()
        self._timers: dict[JobKey, asyncio.TimerHandle] = {}
        self._failures: dict[JobKey, Backoff] = {}
        self._evented: set[str] = set()
        self._reported_invalid: dict[JobKey, str] = {}
        self._capacity_generation = 0  # bumped by every change that can move free capacity
        self._capacity_cache: dict[tuple, tuple[int, int]] = {}
        self._cost_saved_at = 0.0
        self._informers: list[Informer] = []
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, sync_timeout: float = 30.0) -> None:
        """Starts informers and workers; returns once the caches hold a first full list."""
        self.loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        ns = self.config.namespace
        self._informers = [Informer(self.kube, NODES, None, self._on_node_event, self.loop),
                           Informer(self.kube, PODS, ns, self._on_pod_event, self.loop)]
        for adapter in self.adapters.values():
            self._informers.append(Informer(
                self.kube, adapter.resource, ns, self._job_handler(adapter), self.loop,
                label_selector={names.LABEL_MANAGED: "true"}, optional=adapter.optional))
        for informer in self._informers:
            informer.start()
        await asyncio.wait_for(asyncio.gather(*(i.synced.wait() for i in self._informers)), sync_timeout)
        self._tasks = [asyncio.create_task(self._worker(), name=f"supervisor-worker-{i}")
                       for i in range(max(1, self.config.workers))]
        self._tasks.append(asyncio.create_task(self._resync_loop(), name="supervisor-resync"))
        self._tasks.append(asyncio.create_task(self._cost_loop(), name="supervisor-cost"))
        self.metrics.registry.add_collector(self._collect)
        self.enqueue_all()

    async def stop(self) -> None:
        self._stop.set()
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(i.stop) for i in self._informers))

    async def __aenter__(self) -> "Controller":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader()

    def on_leadership(self, leader: bool) -> None:
        """Elector callback: a new leader reconciles everything at once."""
        self.metrics.leader.set(1 if leader else 0)
        if leader and self._queue is not None:
            self.enqueue_all()

    # ---- queue -----------------------------------------------------------------------------
    def enqueue(self, key: JobKey, delay: float = 0.0) -> None:
        if self._queue is None or self._stop.is_set():
            return
        if delay > 0:
            when = self.loop.time() + delay
            timer = self._timers.get(key)
            if timer is not None and not timer.cancelled() and timer.when() <= when:
                return
            if timer is not None:
                timer.cancel()
            self._timers[key] = self.loop.call_at(when, self._fire_timer, key)
            return
        if key in self._busy:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def _fire_timer(self, key: JobKey) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    def enqueue_all(self) -> None:
        for key in list(self.jobs):
            self.enqueue(key)

    def _enqueue_waiting(self) -> None:
        """Jobs that may use freed capacity: suspended by us, or elastic below their max."""
        for key, obj in list(self.jobs.items()):
            annotations = _meta(obj).get("annotations") or {}
            status = annotations.get(names.ANN_STATUS) or ""
            if ('"phase":"Suspended"' in status or '"capacity":"on-demand"' in status
                    or annotations.get(names.ANN_POLICY) == ELASTIC):
                self.enqueue(key)

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._busy.add(key)
            try:
                await self.reconcile(key)
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.errors.inc()
                delay = self._failures.setdefault(key, Backoff(base=0.5, cap=30.0)).next_delay()
                log.warning("reconcile %s/%s/%s failed (%s); retrying in %.1fs", *key, exc, delay,
                            exc_info=not isinstance(exc, ApiError))
                self.enqueue(key, delay)
            finally:
                self._busy.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync)
            self.enqueue_all()

    async def _cost_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cost_interval)
            self._observe_costs()
            if time.monotonic() - self._cost_saved_at >= self.config.cost_save_interval:
                self._cost_saved_at = time.monotonic()
                await self._save_costs()

    # ---- cache maintenance (event loop) ----------------------------------------------------
    def _on_node_event(self, kind: str, payload: Any) -> None:
        if kind == "SYNC":
            self.nodes = {_meta(n).get("name"): n for n in payload if _meta(n).get("name")}
            self._notice_cache.clear()
            self._capacity_generation += 1
            self.enqueue_all()
            return
        name = _meta(payload).get("name")
        if not name:
            return
        old = self.nodes.get(name)
        if kind == "DELETED":
            self.nodes.pop(name, None)
        else:
            self.nodes[name] = payload
        new = self.nodes.get(name)
        if _node_signature(old) == _node_signature(new):
            return
        self._capacity_generation += 1
        notice_text = (_meta(new).get("annotations") or {}).get(names.ANN_NOTICE) if new else None
        if notice_text and notice_text != ((_meta(old).get("annotations") or {}).get(names.ANN_NOTICE) if old else None):
            self._notice_seen_at[name] = time.monotonic()
        for pod_key in self._pods_by_node.get(name, ()):
            owner = self._pod_owner.get(pod_key)
            if owner in self.jobs:
                self.enqueue(owner)
        if new is not None and capacity.node_healthy(new):
            self._enqueue_waiting()

    def _on_pod_event(self, kind: str, payload: Any) -> None:
        if kind == "SYNC":
            for key in list(self.pods):
                self._unindex_pod(key)
            self.pods.clear()
            for pod in payload:
                self._index_pod(pod)
            self._capacity_generation += 1
            self.enqueue_all()
            return
        meta = _meta(payload)
        key = (meta.get("namespace", ""), meta.get("name", ""))
        old = self.pods.get(key)
        was_active = old is not None and capacity.pod_active(old)
        if _pod_signature(old) != _pod_signature(payload if kind != "DELETED" else None):
            self._capacity_generation += 1
        self._unindex_pod(key)
        if kind != "DELETED":
            self._index_pod(payload)
        owner = self._pod_owner.get(key) or self._owner_of(payload)
        if owner in self.jobs:
            self.enqueue(owner)
        if was_active and (kind == "DELETED" or not capacity.pod_active(payload)):
            self._enqueue_waiting()

    def _owner_of(self, pod: Mapping[str, Any]) -> JobKey | None:
        for ref in _meta(pod).get("ownerReferences") or []:
            if not ref.get("controller", True):
                continue
            for adapter in self.adapters.values():
                if adapter.owns(ref):
                    return (adapter.kind, _meta(pod).get("namespace", ""), ref.get("name", ""))
        return None

    def _index_pod(self, pod: dict) -> None:
        meta = _meta(pod)
        key = (meta.get("namespace", ""), meta.get("name", ""))
        self.pods[key] = pod
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            self._pods_by_node.setdefault(node, set()).add(key)
            self._pod_node[key] = node
        owner = self._owner_of(pod)
        if owner is not None:
            self._pods_by_owner.setdefault(owner, set()).add(key)
            self._pod_owner[key] = owner

    def _unindex_pod(self, key: PodKey) -> None:
        self.pods.pop(key, None)
        node = self._pod_node.pop(key, None)
        if node is not None:
            self._pods_by_node.get(node, set()).discard(key)
        owner = self._pod_owner.pop(key, None)
        if owner is not None:
            self._pods_by_owner.get(owner, set()).discard(key)

    def _job_handler(self, adapter: JobAdapter):
        def handle(kind: str, payload: Any) -> None:
            if kind == "SYNC":
                for key in [k for k in self.jobs if k[0] == adapter.kind]:
                    self.jobs.pop(key)
                for obj in payload:
                    key = (adapter.kind, _meta(obj).get("namespace", ""), _meta(obj).get("name", ""))
                    self.jobs[key] = obj
                    self._restore_cost(key, obj)
                    self.enqueue(key)
                return
            key = (adapter.kind, _meta(payload).get("namespace", ""), _meta(payload).get("name", ""))
            if kind == "DELETED":
                self.jobs.pop(key, None)
                self.ledger.forget(key)
                self._reported_invalid.pop(key, None)
                return
            self.jobs[key] = payload
            self._restore_cost(key, payload)
            self.enqueue(key)
        return handle

    # ---- state reduction (pure reads of the caches) ----------------------------------------
    def node_notice(self, node: Mapping[str, Any] | None) -> Notice | None:
        """The node's notice (parsed once per annotation value); None if absent or unreadable."""
        if node is None:
            return None
        text = (_meta(node).get("annotations") or {}).get(names.ANN_NOTICE)
        if not text:
            return None
        if text not in self._notice_cache:
            try:
                self._notice_cache[text] = Notice.from_json(text)
            except NoticeFormatError as exc:
                log.warning("node %s: ignoring unreadable %s annotation: %s", _meta(node).get("name"), names.ANN_NOTICE, exc)
                self._notice_cache[text] = None
            if len(self._notice_cache) > 10000:
                self._notice_cache.clear()
        return self._notice_cache.get(text)

    def replica_pods(self, key: JobKey, adapter: JobAdapter) -> list[dict]:
        pods = (self.pods.get(k) for k in self._pods_by_owner.get(key, ()))
        return [p for p in pods if p is not None and capacity.pod_active(p) and adapter.is_replica_pod(p)]

    def _drained(self, pods: Iterable[Mapping[str, Any]], since: datetime | None) -> bool:
        """Whether a container exited 83/84 (in `state` or `lastState`) at or after `since`:
        an older drain (restartPolicy OnFailure keeps it in lastState) belongs to an earlier
        notice, and an exit without finishedAt cannot be told from one (progress.drained_exits)."""
        return any(True for _ in progress.drained_exits(pods, since))

    def _checkpoint_since(self, pods: Iterable[Mapping[str, Any]], record: Record) -> datetime | None:
        """When the notices being checkpointed began: the earliest detection of a handled notice
        still on one of the job's nodes, else the supervisor's decision time."""
        times = [record.decided_at] if record.decided_at is not None else []
        for pod in pods:
            notice = self.node_notice(self.nodes.get((pod.get("spec") or {}).get("nodeName") or ""))
            if notice is not None and notice.id in record.handled:
                times.append(notice.detected_at)
        return min(times) if times else None

    def job_state(self, key: JobKey, obj: Mapping[str, Any], adapter: JobAdapter, policy, record: Record) -> JobState:
        all_pods = [self.pods[k] for k in self._pods_by_owner.get(key, ()) if k in self.pods]
        replicas = [p for p in all_pods if capacity.pod_active(p) and adapter.is_replica_pod(p)]
        hits: list[NoticeHit] = []
        healthy = 0
        for pod in replicas:
            node_name = (pod.get("spec") or {}).get("nodeName")
            if not node_name:
                continue
            node = self.nodes.get(node_name)
            notice = self.node_notice(node)
            if node is not None and capacity.has_notice(node):
                if notice is not None and notice.kind.value not in NON_ACTING_KINDS:
                    hits.append(NoticeHit(notice.id, node_name, notice.kind.value, notice.deadline))
                elif notice is None or notice.kind.value in NON_ACTING_KINDS:
                    healthy += 1  # a rebalance recommendation (or a taint without notice) departs nobody
                continue
            if node is not None:
                healthy += 1
        unique_hits = tuple({h.id: h for h in hits}.values())
        replicas_now = adapter.replicas(obj)
        suspended = adapter.suspended(obj)
        free = alt = 0
        directives = adapter.directives(obj) if policy.fallback is not None or record.move_to else {}
        if needs_capacity(policy, record, replicas_now, suspended):
            free = self.free_slots(key, adapter.pod_spec(obj), ignore_own=suspended)
            alt_spec = self._alternative_pod_spec(adapter, obj, directives, record)
            if alt_spec is not None:
                alt = self.free_slots(key, alt_spec, ignore_own=True)
        drained = record.phase == CHECKPOINTING and self._drained(all_pods, self._checkpoint_since(all_pods, record))
        return JobState(policy=policy, replicas=replicas_now, suspended=suspended, record=record,
                        notices=unique_hits, healthy_replicas=healthy, free_slots=free, drained=drained,
                        directives=directives, alt_slots=alt, template_mutable=adapter.template_mutable(obj))

    @staticmethod
    def _alternative_pod_spec(adapter: JobAdapter, obj: Mapping[str, Any], directives: Mapping[str, Mapping],
                              record: Record) -> dict | None:
        """The replica pod spec on the other capacity: on-demand while on spot, the saved spot
        directives while on on-demand (fallback.py); None when there is none."""
        if not directives:
            return None
        other = record.spot_directives if record.capacity == ON_DEMAND else on_demand_directives(directives)
        wanted = (other or {}).get(adapter.replica_role)
        return None if wanted is None else {**adapter.pod_spec(obj), **wanted}

    def free_slots(self, key: JobKey, pod_spec: Mapping[str, Any], ignore_own: bool) -> int:
        """capacity.free_slots over the caches, memoized per pod shape until capacity changes."""
        shape = repr((pod_spec.get("containers") and [c.get("resources") for c in pod_spec["containers"]],
                      pod_spec.get("initContainers") and [c.get("resources") for c in pod_spec["initContainers"]],
                      pod_spec.get("nodeSelector"), pod_spec.get("affinity"), pod_spec.get("tolerations")))
        cache_key = (shape, key if ignore_own else None)
        cached = self._capacity_cache.get(cache_key)
        if cached is not None and cached[0] == self._capacity_generation:
            return cached[1]
        own = set(self._pods_by_owner.get(key, ())) if ignore_own else set()
        ignore = (lambda p: (_meta(p).get("namespace", ""), _meta(p).get("name", "")) in own) if ignore_own else None
        by_node = {n: [self.pods[k] for k in ks if k in self.pods] for n, ks in self._pods_by_node.items() if ks}
        value = capacity.free_slots(self.nodes.values(), by_node, pod_spec, ignore)
        if len(self._capacity_cache) > 4096:
            self._capacity_cache.clear()
        self._capacity_cache[cache_key] = (self._capacity_generation, value)
        return value

    # ---- reconcile -------------------------------------------------------------------------
    async def reconcile(self, key: JobKey) -> Decision | None:
        """One pass over one job (see the module docstring). Returns the decision taken."""
        obj = self.jobs.get(key)
        adapter = self.adapters.get(key[0])
        if obj is None or adapter is None or adapter.finished(obj) or not self.is_leader():
            return None
        annotations = _meta(obj).get("annotations") or {}
        try:
            policy = parse_policy(annotations, adapter.default_max(obj), adapter.default_min(obj))
        except PolicyError as exc:
            await self._report_invalid(key, obj, exc)
            return None
        self._reported_invalid.pop(key, None)
        try:
            record = parse_record(annotations.get(names.ANN_STATUS))
        except RecordError as exc:
            log.warning("job %s/%s: unreadable %s (%s); starting a fresh record", key[1], key[2], names.ANN_STATUS, exc)
            record = Record()
        state = self.job_state(key, obj, adapter, policy, record)
        now = _now()
        decision = decide(state, now, self.config.settings, self.config.identity)
        if decision.acts and key in self.ledger.jobs:  # the cost totals travel with every decision
            decision = replace(decision, record=decision.record.with_(cost=self.ledger.jobs[key].totals()))
        if decision.action == SCALE:  # the new membership travels with the decision: one write less
            hosts = self._members(key, adapter)[1]
            if hosts and hosts != decision.record.members:
                decision = replace(decision, record=decision.record.with_(
                    generation=decision.record.generation + 1, members=hosts))
        if decision.acts:
            applied = await self._apply(key, obj, adapter, decision)
            if applied is None:
                return None
            if set(decision.record.handled) - set(record.handled):
                self._observe_latency(key)
            obj, record = applied, decision.record
        if decision.recheck_at is not None:
            self.enqueue(key, max(0.05, (decision.recheck_at - _now()).total_seconds() + 0.01))
        await self._ensure_event(obj, record)
        obj = await self._ensure_conditions(key, obj, adapter, record)
        if obj is not None:
            obj = await self._ensure_steps_lost(key, obj, adapter)
        if obj is not None and policy.mode == ELASTIC:
            await self._ensure_membership(key, obj, adapter, record)
        if obj is not None and record.drain and record.phase == CHECKPOINTING:
            await self._ensure_drain(key, obj, adapter, record)
        return decision

    async def _apply(self, key: JobKey, obj: dict, adapter: JobAdapter, decision: Decision) -> dict | None:
        """Writes the decision as one conditional patch; None when it must be re-decided."""
        if decision.action == SCALE:
            body = adapter.scale_patch(decision.replicas)
        elif decision.action == SUSPEND:
            body = adapter.suspend_patch(True)
        elif decision.action == RESUME:
            body = adapter.suspend_patch(False, decision.replicas)
        elif decision.action == MOVE:
            body = merge(adapter.suspend_patch(False, decision.replicas),
                         adapter.directives_patch(obj, decision.directives or {}))
        else:
            body = {}
        meta: dict = {"annotations": {names.ANN_STATUS: decision.record.to_json()}}
        if _meta(obj).get("resourceVersion"):
            meta["resourceVersion"] = _meta(obj)["resourceVersion"]
        body = merge(body, {"metadata": meta})
        new = await self._write_job(key, adapter, body)
        if new is None:
            return None
        self.metrics.decisions.inc(action=decision.action, reason=decision.reason)
        log.info("job %s/%s: %s", key[1], key[2], decision.message,
                 extra={"action": decision.action, "replicas": decision.replicas, "key": decision.key})
        return new

    async def _write_job(self, key: JobKey, adapter: JobAdapter, body: dict, *, status: bool = False) -> dict | None:
        if not self.is_leader():
            return None
        try:
            new = await asyncio.to_thread(self.kube.patch, adapter.resource, key[1], key[2], body, status=status)
        except Conflict:
            self.metrics.conflicts.inc()
            try:
                self.jobs[key] = await asyncio.to_thread(self.kube.get, adapter.resource, key[1], key[2])
            except NotFound:
                self.jobs.pop(key, None)
                return None
            self.enqueue(key)
            return None
        except NotFound:
            self.jobs.pop(key, None)
            return None
        self.jobs[key] = new
        return new

    def _observe_latency(self, key: JobKey) -> None:
        seen = [self._notice_seen_at.get(self._pod_node.get(p, "")) for p in self._pods_by_owner.get(key, ())]
        seen = [s for s in seen if s is not None]
        if seen:
            self.metrics.notice_to_patch.observe(time.monotonic() - max(seen))

    async def _report_invalid(self, key: JobKey, obj: Mapping[str, Any], exc: PolicyError) -> None:
        text = f"{exc.field}: {exc.message}"
        if self._reported_invalid.get(key) == text:
            return
        message = f"invalid policy annotation {exc.field}: {exc.message}; the job is left untouched"
        ok = await self._create_event(obj, key=decision_key("invalid", _meta(obj).get("uid", ""), text),
                                      reason=names.EVENT_INVALID_POLICY, message=message, event_type="Warning",
                                      action="Validate")
        if ok:
            self._reported_invalid[key] = text
        log.warning("job %s/%s: %s", key[1], key[2], message)

    async def _create_event(self, obj: Mapping[str, Any], *, key: str, reason: str, message: str, event_type: str,
                            action: str) -> bool:
        if not self.is_leader():
            return False
        body = event_body(obj, key=key, reason=reason, message=message, event_type=event_type, action=action,
                          identity=self.config.identity, now=_now())
        try:
            await asyncio.to_thread(self.kube.create, EVENTS, _meta(obj).get("namespace", "default"), body)
        except Conflict:
            pass  # the same decision's Event exists already
        return True

    async def _ensure_event(self, obj: Mapping[str, Any], record: Record) -> None:
        if not record.key or record.key in self._evented:
            return
        event_type = ("Warning" if record.event in (names.EVENT_MAX_WAIT, names.EVENT_SUSPENDED, names.EVENT_FELL_BACK)
                      else "Normal")
        if await self._create_event(obj, key=record.key, reason=record.event or "SpotguardDecision",
                                    message=record.message, event_type=event_type, action=record.phase):
            self._evented.add(record.key)
            if len(self._evented) > 100000:
                self._evented.clear()

    async def _ensure_conditions(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> dict | None:
        new_conditions = conditions.merged((obj.get("status") or {}).get("conditions"), record, _now())
        if new_conditions is None:
            return obj
        body: dict = {"status": {"conditions": new_conditions}}
        if _meta(obj).get("resourceVersion"):
            body["metadata"] = {"resourceVersion": _meta(obj)["resourceVersion"]}
        return await self._write_job(key, adapter, body, status=True)

    def _members(self, key: JobKey, adapter: JobAdapter) -> tuple[list[dict], tuple[str, ...], list[dict]]:
        """(active replica pods, member hosts, member pods): members run on nodes without a notice."""
        pods = self.replica_pods(key, adapter)
        members = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"
                   and (p.get("spec") or {}).get("nodeName") in self.nodes
                   and not capacity.has_notice(self.nodes[(p.get("spec") or {})["nodeName"]])]
        return pods, membership.hosts_of(members, self.config.membership_hosts), members

    async def _ensure_membership(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> None:
        """Elastic jobs the supervisor has acted on: pushes the hosts of the running replicas on
        nodes without a notice (new generation when they change) to every active replica pod."""
        if record.decided_at is None or record.phase != RUNNING or adapter.suspended(obj):
            return
        pods, hosts, members = self._members(key, adapter)
        if not hosts:
            return
        if hosts != record.members:
            record = record.with_(generation=record.generation + 1, members=hosts)
            meta: dict = {"annotations": {names.ANN_STATUS: record.to_json()}}
            if _meta(obj).get("resourceVersion"):
                meta["resourceVersion"] = _meta(obj)["resourceVersion"]
            if await self._write_job(key, adapter, {"metadata": meta}) is None:
                return
        world = len(hosts) * membership.processes_per_replica(adapter.pod_spec(obj)) \
            if self.config.membership_hosts == "node" else len(members) * membership.processes_per_replica(adapter.pod_spec(obj))
        value = membership.membership_json(record.generation, hosts, world)
        for pod in membership.pods_to_update(pods, value):
            if not self.is_leader():
                return
            meta = _meta(pod)
            try:
                await asyncio.to_thread(self.kube.patch, PODS, meta.get("namespace"), meta.get("name"),
                                        membership.pod_patch(value))
            except NotFound:
                continue

    async def _ensure_drain(self, key: JobKey, obj: dict, adapter: JobAdapter, record: Record) -> None:
        """A return to spot under way: the drain request rides the membership annotation to every
        active replica pod (sidecar -> Guard: a `drain` notice, checkpoint, exit 83)."""
        pods, hosts, members = self._members(key, adapter)
        world = len(members) * membership.processes_per_replica(adapter.pod_spec(obj))
        value = membership.membership_json(record.generation, hosts, world, drain=record.drain)
        for pod in membership.pods_to_update(pods, value):
            if not self.is_leader():
                return
            try:
                await asyncio.to_thread(self.kube.patch, PODS, _meta(pod).get("namespace"), _meta(pod).get("name"),
                                        membership.pod_patch(value))
            except NotFound:
                continue

    async def _ensure_steps_lost(self, key: JobKey, obj: dict, adapter: JobAdapter) -> dict | None:
        """Adds the steps lost that newly drained pods report (their termination message) to the
        record and writes the total as `spotguard.io/steps-lost`."""
        annotations = _meta(obj).get("annotations") or {}
        try:
            record = parse_record(annotations.get(names.ANN_STATUS))
        except RecordError:
            return obj
        pods = [self.pods[k] for k in self._pods_by_owner.get(key, ()) if k in self.pods]
        counted = progress.count_steps_lost(pods, record.steps_lost, record.counted_exits)
        if counted is None and (record.decided_at is None or annotations.get(names.ANN_STEPS_LOST) is not None):
            return obj
        total, exits = counted or (record.steps_lost, record.counted_exits)
        meta: dict = {"annotations": {names.ANN_STATUS: record.with_(steps_lost=total, counted_exits=exits).to_json(),
                                      names.ANN_STEPS_LOST: str(total)}}
        if _meta(obj).get("resourceVersion"):
            meta["resourceVersion"] = _meta(obj)["resourceVersion"]
        return await self._write_job(key, adapter, {"metadata": meta})

    # ---- cost ------------------------------------------------------------------------------
    def _restore_cost(self, key: JobKey, obj: Mapping[str, Any]) -> None:
        if key in self.ledger.jobs:
            return
        try:
            record = parse_record((_meta(obj).get("annotations") or {}).get(names.ANN_STATUS))
        except RecordError:
            return
        self.ledger.restore(key, record.cost)

    async def _save_costs(self) -> None:
        """Writes each job's cost totals into its decision record when they changed (leader only)."""
        for key, obj in list(self.jobs.items()):
            entry, adapter = self.ledger.jobs.get(key), self.adapters.get(key[0])
            if entry is None or adapter is None or not self.is_leader():
                continue
            annotations = _meta(obj).get("annotations") or {}
            try:
                record = parse_record(annotations.get(names.ANN_STATUS))
            except RecordError:
                continue
            totals = entry.totals()
            if record.decided_at is None and not totals["cost"] and not totals["spot_hours"] \
                    and not totals["on_demand_hours"] or record.cost == totals:
                continue
            meta: dict = {"annotations": {names.ANN_STATUS: record.with_(cost=totals).to_json()}}
            if _meta(obj).get("resourceVersion"):
                meta["resourceVersion"] = _meta(obj)["resourceVersion"]
            try:
                await self._write_job(key, adapter, {"metadata": meta})
            except ApiError as exc:
                log.warning("saving the cost of %s/%s failed: %s", key[1], key[2], exc)

    def _observe_costs(self) -> None:
        now = time.monotonic()
        for key in list(self.jobs):
            adapter = self.adapters.get(key[0])
            if adapter is None:
                continue
            node_names = {(p.get("spec") or {}).get("nodeName") for p in self.replica_pods(key, adapter)
                          if (p.get("status") or {}).get("phase") == "Running"}
            self.ledger.observe(key, [self.nodes[n] for n in node_names if n in self.nodes], now)

    def _collect(self) -> None:
        self._observe_costs()
        m = self.metrics
        for family in (m.cost, m.on_demand, m.savings, m.spot_hours, m.on_demand_hours, m.reclaims, m.steps_lost):
            family.clear()
        m.managed_jobs.set(len(self.jobs))
        m.leader.set(1 if self.is_leader() else 0)
        for key, obj in self.jobs.items():
            labels = {"kind": key[0], "namespace": key[1], "job": key[2]}
            entry = self.ledger.jobs.get(key)
            if entry is not None:
                m.cost.set(entry.cost, **labels)
                m.on_demand.set(entry.on_demand_equivalent, **labels)
                m.savings.set(entry.savings_ratio, **labels)
                m.spot_hours.set(entry.spot_hours, **labels)
                m.on_demand_hours.set(entry.on_demand_hours, **labels)
            annotations = _meta(obj).get("annotations") or {}
            try:
                m.reclaims.set(parse_record(annotations.get(names.ANN_STATUS)).reclaims_survived, **labels)
            except RecordError:
                pass
            lost = str(annotations.get(names.ANN_STEPS_LOST, "")).strip()
            if lost.isdigit():
                m.steps_lost.set(int(lost), **labels)
