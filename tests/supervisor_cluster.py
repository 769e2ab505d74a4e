"""A small Kubernetes world for supervisor tests: the resourceVersion-aware kmock emulator on a
real HTTP socket (127.0.0.1, ephemeral port), plus helpers that create Nodes, Pods and Jobs
through the official client and read them back. No fixture here (see test files)."""
from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta, UTC
from typing import Any
from collections.abc import AsyncIterator

import kmock

from spotguard.kube import load_api_client
from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.kube.api import EVENTS, JOBS, NODES, PODS, PYTORCHJOBS, Kube, NotFound
from spotguard.supervisor.policy import Settings
from spotguard.supervisor.testing import VersionedKubernetesEmulator
from spotguard.wire import names
from spotguard.wire.notice import Notice, notice_id

NS = "train"


class Cluster:
    """Helpers over one emulator. All calls go over HTTP through `Kube` in threads."""

    def __init__(self, emulator, url: str):
        self.emulator = emulator
        self.url = url
        self.kube = Kube(load_api_client(host=url))

    async def call(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def add_node(self, name: str, gpus: int = 1, ready: bool = True, labels: dict | None = None) -> dict:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
                "spec": {},
                "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        return await self.call(self.kube.create, NODES, None, body)

    async def add_job(self, name: str, replicas: int = 4, annotations: dict | None = None, kind: str = "Job",
                      gpus: int = 1) -> dict:
        template = {"spec": {"containers": [{"name": "train", "image": "x",
                                             "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]}}
        meta = {"name": name, "namespace": NS, "labels": {names.LABEL_MANAGED: "true"},
                "annotations": dict(annotations or {}), "uid": f"uid-{name}"}
        if kind == "Job":
            body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                    "spec": {"parallelism": replicas, "completions": replicas, "completionMode": "Indexed",
                             "suspend": False, "template": template}}
            return await self.call(self.kube.create, JOBS, NS, body)
        body = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
                "spec": {"elasticPolicy": {"minReplicas": 1, "maxReplicas": replicas},
                         "runPolicy": {"suspend": False},
                         "pytorchReplicaSpecs": {"Worker": {"replicas": replicas, "template": template}}}}
        return await self.call(self.kube.create, PYTORCHJOBS, NS, body)

    async def add_pod(self, job: str, index: int, node: str, kind: str = "Job", gpus: int = 1) -> dict:
        api_version = "batch/v1" if kind == "Job" else "kubeflow.org/v1"
        labels = {"training.kubeflow.org/replica-type": "worker"} if kind != "Job" else {}
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{job}-{index}", "namespace": NS, "labels": labels,
                             "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                             "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": job,
                                                  "uid": f"uid-{job}", "controller": True}]},
                "spec": {"nodeName": node, "containers": [{"name": "train", "image": "x",
                                                           "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]},
                "status": {"phase": "Running", "podIP": f"10.0.0.{index + 1}"}}
        return await self.call(self.kube.create, PODS, NS, body)

    async def add_job_with_pods(self, name: str, nodes: list[str], annotations: dict | None = None,
                                kind: str = "Job") -> dict:
        job = await self.add_job(name, len(nodes), annotations, kind=kind)
        for i, node in enumerate(nodes):
            await self.add_pod(name, i, node, kind=kind)
        return job

    async def notice(self, node: str, kind: str = "reclaim", deadline_in: float | None = 120.0,
                     ident: str = "1") -> Notice:
        now = datetime.now(UTC)
        notice = Notice(id=notice_id("aws.spot", node, ident), kind=kind, source="aws.spot", node=node, detected_at=now,
                        deadline=None if deadline_in is None else now + timedelta(seconds=deadline_in))
        await self.call(self.kube.patch, NODES, None, node, {
            "metadata": {"annotations": {names.ANN_NOTICE: notice.to_json()}},
            "spec": {"taints": [{"key": names.TAINT_RECLAIM, "value": kind, "effect": "NoSchedule"}]}})
        return notice

    async def exit_pod(self, job: str, index: int, code: int, finished_at: datetime | None = None,
                       restarted: bool = False) -> None:
        """Container `train` exited `code` at `finished_at` (default now), as a kubelet writes it:
        `restarted` keeps the pod Running with the exit in lastState (restartPolicy OnFailure)."""
        finished = (finished_at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
        term = {"terminated": {"exitCode": code, "finishedAt": finished}}
        status = ({"name": "train", "state": {"running": {"startedAt": finished}}, "lastState": term} if restarted
                  else {"name": "train", "state": term})
        await self.call(self.kube.patch, PODS, NS, f"{job}-{index}", {"status": {
            "phase": "Running" if restarted else "Failed", "containerStatuses": [status]}})

    async def job(self, name: str, kind: str = "Job") -> dict:
        return await self.call(self.kube.get, JOBS if kind == "Job" else PYTORCHJOBS, NS, name)

    async def pod(self, name: str) -> dict:
        return await self.call(self.kube.get, PODS, NS, name)

    async def events(self, job: str, reason: str | None = None) -> list[dict]:
        try:
            items, _ = await self.call(self.kube.list, EVENTS, NS)
        except NotFound:  # kmock knows a resource once an object of it exists
            return []
        return [e for e in items if (e.get("involvedObject") or {}).get("name") == job
                and (reason is None or e.get("reason") == reason)]

    def job_versions(self, name: str, resource: str = "batch/v1/jobs") -> list[dict]:
        """Every stored version of the job (kmock's history), oldest first."""
        obj = self.emulator.objects[kmock.resource(resource), NS, name]
        return [dict(v) for v in obj.history if v is not None]

    def spec_writes(self, name: str, resource: str = "batch/v1/jobs") -> list[dict]:
        """The distinct spec states the job went through (consecutive duplicates dropped)."""
        out: list[dict] = []
        for version in self.job_versions(name, resource):
            spec = version.get("spec") or {}
            state = {"parallelism": spec.get("parallelism"), "suspend": spec.get("suspend")}
            if not out or out[-1] != state:
                out.append(state)
        return out

    def controller(self, identity: str = "sup-a", elector=None, **settings: Any) -> Controller:
        config = ControllerConfig(identity=identity, namespace=NS, resync=settings.pop("resync", 30.0),
                                  settings=Settings(checkpoint_timeout=settings.pop("checkpoint_timeout", 30.0),
                                                    scale_out_delay=settings.pop("scale_out_delay", 0.2)),
                                  workers=2, join_settle=settings.pop("join_settle", 10.0))
        return Controller(Kube(load_api_client(host=self.url)), config, elector=elector)


@contextlib.asynccontextmanager
async def running_cluster() -> AsyncIterator[Cluster]:
    emulator = VersionedKubernetesEmulator()
    async with emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, str(server.url).rstrip("/"))
        try:
            yield cluster
        finally:
            cluster.kube.api_client.close()


async def eventually(check, timeout: float = 20.0, pause: float = 0.05, what: str = "condition"):
    """Awaits `check()` (async, returns a truthy value or raises AssertionError) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Exception | None = None
    while True:
        try:
            value = await check()
            if value:
                return value
        except (AssertionError, NotFound, KeyError) as exc:
            last = exc
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")
        await asyncio.sleep(pause)
