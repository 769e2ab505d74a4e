"""The kubelet of one simulated node instance.

`Kubelet(kube, node, ...)`; `await start()` registers the Node (Ready, schedulable, allocatable
one `nvidia.com/gpu`, the given labels, a fresh `bootID`) and follows the pods bound to it: each
new one gets a `PodRunner` (pod_runner.py: sidecar, downward-API file, the container as a local
process, status), a deleted one is terminated within its grace period, the readiness probe runs
every `probe_period` seconds. `die()`: the instance is gone (a reclaim at its deadline): every
process of every pod is killed at once (those of a running container that can first write their
threads' stacks to its log do, `reaper.dump_stacks`) and the kubelet writes nothing more (the
cluster then deletes the Node and fails its pods, as the pod garbage collector does).
`stop(grace)`: the end of the dry-run: every pod's container gets SIGTERM, then after `grace`
seconds is killed.

`LaunchEpochs` numbers the job's launches for the trainers' event logs (`SPOTGUARD_GENERATION`):
a container that starts while no other container of its job runs starts a new epoch (the first
launch, a relaunch after a fallback, a resume); one that starts beside running ones (a joiner,
a scale-out) shares theirs. `launched_at[(job uid, epoch)]`: when its first container started.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotguard.kube.api import NODES, PODS, NotFound
from spotguard.trainer.cluster.job_pods import UID_LABEL, terminal
from spotguard.trainer.cluster.kube import LocalKube, rfc3339
from spotguard.trainer.cluster.loop import Wakeup, keep_reconciling
from spotguard.trainer.cluster.pod_runner import PodRunner

log = logging.getLogger(__name__)


class LaunchEpochs:
    """See the module docstring."""

    def __init__(self) -> None:
        self._running: dict[str, set[str]] = {}
        self._epochs: dict[str, int] = {}

    @staticmethod
    def _job(pod: Mapping[str, Any]) -> str:
        return str(((pod.get("metadata") or {}).get("labels") or {}).get(UID_LABEL, ""))

    def started(self, pod: Mapping[str, Any], pod_uid: str) -> int:
        job = self._job(pod)
        running = self._running.setdefault(job, set())
        if not running:
            self._epochs[job] = self._epochs.get(job, -1) + 1
        running.add(pod_uid)
        return self._epochs[job]

    def ended(self, pod: Mapping[str, Any], pod_uid: str) -> None:
        self._running.get(self._job(pod), set()).discard(pod_uid)


def node_object(name: str, labels: Mapping[str, str], ip: str) -> dict:
    """The Node a kubelet registers: Ready, one GPU, a fresh boot id."""
    resources = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1", "pods": "110"}
    now = rfc3339()
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {},
            "status": {"capacity": dict(resources), "allocatable": dict(resources),
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastHeartbeatTime": now, "lastTransitionTime": now}],
                       "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
                       "nodeInfo": {"bootID": str(uuid.uuid4()), "machineID": uuid.uuid4().hex,
                                    "kubeletVersion": "dry-run"}}}


class Kubelet:
    """See the module docstring. `agent_url` / `report_secret`: the node agent the pods' sidecars
    talk to; `env`: the run's variables every container gets."""

    def __init__(self, kube: LocalKube, node: str, *, run_dir: Path, agent_url: str, report_secret: Path,
                 epochs: LaunchEpochs, labels: Mapping[str, str], env: Mapping[str, str] | None = None,
                 ip: str = "127.0.0.1", probe_period: float = 0.1):
        self.kube, self.node, self.run_dir, self.ip = kube, node, run_dir, ip
        self.agent_url, self.report_secret, self.epochs = agent_url, report_secret, epochs
        self.labels, self.env, self.probe_period = dict(labels), dict(env or {}), probe_period
        self.pods: dict[str, PodRunner] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.kube.create(NODES, None, node_object(self.node, self.labels, self.ip))
        wakeup = Wakeup()
        self.kube.subscribe(wakeup)
        self._loop_task = asyncio.create_task(keep_reconciling(self.sync, wakeup, self.probe_period,
                                                               name=f"kubelet {self.node}"))

    def sync(self) -> float:
        pods, _ = self.kube.list(PODS, None, field_selector=f"spec.nodeName={self.node}")
        for pod in pods:
            runner = self.pods.get(pod["metadata"]["uid"])
            if runner is None:
                self._admit(pod)
            else:
                runner.observe(pod)
                if pod["metadata"].get("deletionTimestamp") and not runner.deleting:
                    grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
                    self._spawn(runner.terminate(grace))
        for runner in self.pods.values():
            ready = runner.probe()
            if ready is not None and not runner.done.is_set():
                runner.observe(self._patch_status(runner, runner.ready_status(ready)))
        return self.probe_period

    def _admit(self, pod: dict) -> None:
        if terminal(pod):
            return
        if pod["metadata"].get("deletionTimestamp"):  # deleted before it ever started here
            try:
                self.kube.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], grace_seconds=0)
            except NotFound:
                pass
            return
        runner = PodRunner(self, pod)
        self.pods[runner.uid] = runner
        self._spawn(runner.run())

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _patch_status(self, runner: PodRunner, status: dict) -> dict:
        try:
            return self.kube.patch(PODS, runner.namespace, runner.name, {"status": status}, status=True)
        except NotFound:
            return runner.pod

    async def _halt(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    async def die(self) -> dict[str, list[int]]:
        """The instance is gone (module docstring); returns the pods whose container still ran,
        each with the PIDs of its processes killed then."""
        await self._halt()
        running = [r.name for r in self.pods.values() if r.process is not None and r.process.returncode is None]
        for runner in self.pods.values():
            runner.dead = True
        runners = list(self.pods.values())
        await asyncio.gather(*(r.dump_stacks() for r in runners if r.name in running))
        killed = await asyncio.gather(*(r.kill() for r in runners))
        await asyncio.gather(*(r.done.wait() for r in runners))
        return {r.name: pids for r, pids in zip(runners, killed) if r.name in running}

    async def stop(self, grace: float) -> None:
        """The end of the run (module docstring)."""
        await self._halt()
        await asyncio.gather(*(r.terminate(grace) for r in self.pods.values() if not r.done.is_set()))
        await asyncio.gather(*(r.done.wait() for r in self.pods.values()))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
