"""Bench: node notice annotation written -> managed job patched, through `spotguard supervisor`.

Fills a Kubernetes API emulator (kmock with resourceVersion semantics, real HTTP on 127.0.0.1)
with N elastic Indexed Jobs of R pods each, every pod on its own one-GPU node, starts the
supervisor as a subprocess (the real CLI), waits until it leads, then for each trial writes a
reclaim notice on one node of a different job and measures, on the API server's clock, from
the node PATCH arriving to the job's scaling PATCH arriving. Prints p50/p99/max.

    .venv/bin/python bench/supervisor_latency.py                 # small: 50 jobs, 200 pods
    .venv/bin/python bench/supervisor_latency.py --jobs 500 --pods-per-job 4 --trials 200   # the issue's size
    KUBEBUILDER_ASSETS=... .venv/bin/python bench/supervisor_latency.py --real   # a real kube-apiserver

With `--real` the same world is created in a real etcd + kube-apiserver started through
tests/control_plane.py (no controllers: the admin creates the Jobs, Nodes and Running pods
directly, as the Job controller, the scheduler and kubelets would), the supervisor runs as its
own ServiceAccount (`--kubeconfig`, RBAC of daemonset/base), and the time is taken on the bench's
clock: from just before the node PATCH is sent to the job's watch event showing the new
parallelism (watch delivery included, so it is an upper bound of the API server's view).

The emulator keeps only its last 20 requests (`keep_requests`): kmock matches each request by
scanning its whole request log, which otherwise makes the emulator, not the supervisor, the
bottleneck of a long run. SUPERVISOR_BENCH_LOG=<file> (and SUPERVISOR_BENCH_LOG_LEVEL) keep the
supervisor's log.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, UTC
from pathlib import Path

import kmock

from spotguard.kube import load_api_client
from spotguard.kube.api import NODES, Kube
from spotguard.wire import names
from spotguard.supervisor.testing import VersionedKubernetesEmulator
from spotguard.wire.notice import Notice, notice_id

REPO = Path(__file__).resolve().parents[1]
NS = "bench"


def world(jobs: int, pods_per_job: int):
    """The bench's objects, as (plural, namespace, body): per job its Nodes, the Job, its pods
    (each pod on its own one-GPU spot node, Running, owned by the Job with uid `uid-<job>`)."""
    request = {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    container = {"name": "t", "image": "train:1", "resources": request}
    for j in range(jobs):
        name = f"job{j}"
        for i in range(pods_per_job):
            yield "nodes", None, {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": f"{name}-n{i}", "labels": {"karpenter.sh/capacity-type": "spot"}},
                "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "1", "pods": "110"},
                                       "capacity": {"nvidia.com/gpu": "1", "pods": "110"},
                                       "conditions": [{"type": "Ready", "status": "True"}]}}
        yield "jobs", NS, {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": {names.LABEL_MANAGED: "true"},
                         "annotations": {names.ANN_POLICY: "elastic", names.ANN_MIN_REPLICAS: "1"}},
            "spec": {"parallelism": pods_per_job, "completions": pods_per_job, "completionMode": "Indexed",
                     "suspend": False, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}
        for i in range(pods_per_job):
            yield "pods", NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-{i}", "namespace": NS,
                             "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                  "uid": f"uid-{name}", "controller": True}]},
                "spec": {"nodeName": f"{name}-n{i}", "containers": [container]},
                "status": {"phase": "Running"}}


def populate(emulator, jobs: int, pods_per_job: int) -> None:
    """Stores the objects directly in kmock (setup only; everything measured goes over HTTP)."""
    version = iter(range(1, 10**9))
    resources = {"nodes": kmock.resource("v1/nodes"), "pods": kmock.resource("v1/pods"),
                 "jobs": kmock.resource("batch/v1/jobs")}
    for plural, namespace, body in world(jobs, pods_per_job):
        body["metadata"]["resourceVersion"] = str(next(version))
        emulator.objects[resources[plural], namespace, body["metadata"]["name"]] = body


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def supervisor_command(args, connection: list[str], lease_namespace: str) -> list[str]:
    return [sys.executable, "-m", "spotguard", "supervisor", *connection, "--namespace", NS,
            "--listen", "127.0.0.1:0", "--resync", "3600", "--identity", "bench", "--lease-namespace", lease_namespace,
            "--log-level", os.environ.get("SUPERVISOR_BENCH_LOG_LEVEL", "warning")]


def notice_patch(node: str, trial: int) -> dict:
    now = datetime.now(UTC)
    notice = Notice(id=notice_id("aws.spot", node, trial), kind="reclaim", source="aws.spot", node=node,
                    detected_at=now, deadline=now + timedelta(seconds=120))
    return {"metadata": {"annotations": {names.ANN_NOTICE: notice.to_json()}},
            "spec": {"taints": [{"key": names.TAINT_RECLAIM, "value": "reclaim", "effect": "NoSchedule"}]}}


async def trials(args, kube: Kube, listen: str, node_patch_at: dict, job_patch_at: dict,
                 before_patch: bool = False) -> list[float]:
    """One notice per job in turn; the latency of each (node patch -> job patch, seconds).
    `before_patch`: the bench itself stamps the node patch just before sending it."""
    await wait_leader(listen, args.start_timeout)
    await asyncio.sleep(args.settle)
    latencies = []
    for t in range(min(args.trials, args.jobs)):
        job, node = f"job{t}", f"job{t}-n0"
        if before_patch:
            node_patch_at[node] = time.perf_counter()
        await asyncio.to_thread(kube.patch, NODES, None, node, notice_patch(node, t))
        deadline = time.perf_counter() + 10
        while job not in job_patch_at and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        if job not in job_patch_at:
            raise RuntimeError(f"{job} was not patched within 10 s")
        latencies.append(job_patch_at[job] - node_patch_at[node])
        await asyncio.sleep(args.gap)
    return latencies


class Supervisor:
    """`spotguard supervisor` as a subprocess; `listen` is its metrics address once started."""

    def __init__(self, cmd: list[str]):
        log = open(os.environ.get("SUPERVISOR_BENCH_LOG", os.devnull), "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    async def listen(self, timeout: float) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise RuntimeError(f"supervisor exited early (status {self.proc.poll()})")
        return json.loads(line)["listen"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


async def run(args) -> dict:
    return await (run_real(args) if args.real else run_kmock(args))


async def run_kmock(args) -> dict:
    emulator = VersionedKubernetesEmulator(keep_requests=20)
    node_patch_at: dict[str, float] = {}
    job_patch_at: dict[str, float] = {}

    def on_write(request) -> None:
        if request.method.value.upper() != "PATCH" or request.resource is None or request.subresource:
            return
        if request.resource.plural == "nodes":
            node_patch_at.setdefault(request.name, time.perf_counter())
        elif request.resource.plural == "jobs" and isinstance(request.data, dict) and "spec" in request.data:
            job_patch_at.setdefault(request.name, time.perf_counter())

    emulator.on_write = on_write
    populate(emulator, args.jobs, args.pods_per_job)
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kube = Kube(load_api_client(host=url))
        supervisor = Supervisor(supervisor_command(args, ["--kube-host", url], NS))
        try:
            listen = await supervisor.listen(args.start_timeout)
            latencies = await trials(args, kube, listen, node_patch_at, job_patch_at)
            metrics = await fetch(listen)
        finally:
            supervisor.stop()
            kube.api_client.close()
    return {"latencies": latencies, "metrics": metrics}


async def run_real(args) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.control_plane import SPOTGUARD_NAMESPACE, start_control_plane

    started = time.monotonic()
    plane = await asyncio.to_thread(start_control_plane, False)  # no controllers: the bench plays them
    watcher = None
    try:
        plane.apply_base_access()
        admin = Kube(plane.api_client())
        created = await asyncio.to_thread(create_world, plane, args.jobs, args.pods_per_job)
        print(f"  real kube-apiserver: control plane up and {created} objects created in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        node_patch_at: dict[str, float] = {}
        job_patch_at: dict[str, float] = {}
        watcher = JobWatcher(plane.api_client(), args.pods_per_job, job_patch_at)
        watcher.start()
        kubeconfig = str(plane.kubeconfig("spotguard-supervisor"))
        supervisor = Supervisor(supervisor_command(args, ["--kubeconfig", kubeconfig], SPOTGUARD_NAMESPACE))
        try:
            listen = await supervisor.listen(args.start_timeout)
            latencies = await trials(args, admin, listen, node_patch_at, job_patch_at, before_patch=True)
            metrics = await fetch(listen)
        finally:
            supervisor.stop()
    finally:
        if watcher is not None:
            watcher.stop()
        plane.stop()
    return {"latencies": latencies, "metrics": metrics}


def create_world(plane, jobs: int, pods_per_job: int) -> int:
    """Creates the bench's objects as the admin, in parallel; Nodes Ready and pods Running
    through their status. Returns how many objects."""
    from concurrent.futures import ThreadPoolExecutor

    import kubernetes

    core = kubernetes.client.CoreV1Api(plane.api_client())
    batch = kubernetes.client.BatchV1Api(plane.api_client())
    core.create_namespace({"metadata": {"name": NS}})
    core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})
    objects = list(world(jobs, pods_per_job))

    def create(item) -> None:
        plural, namespace, body = item
        status = {"status": body.pop("status")} if "status" in body else None
        name = body["metadata"]["name"]
        if plural == "nodes":
            core.create_node(body)
            core.patch_node_status(name, status)
        elif plural == "jobs":
            del body["metadata"]["uid"]
            uids[name] = batch.create_namespaced_job(namespace, body).metadata.uid
        else:
            owner = body["metadata"]["ownerReferences"][0]
            owner["uid"] = uids[owner["name"]]
            core.create_namespaced_pod(namespace, body)
            core.patch_namespaced_pod_status(name, namespace, status)

    uids: dict[str, str] = {}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, [o for o in objects if o[0] != "pods"]))  # Jobs first: pods need their uid
        list(pool.map(create, [o for o in objects if o[0] == "pods"]))
    return len(objects)


class JobWatcher:
    """Watches the bench's Jobs in a thread; stamps each job's first event whose parallelism
    is below the full size (the supervisor's scaling patch, as the API server committed it)."""

    def __init__(self, api_client, full: int, stamps: dict[str, float]):
        import kubernetes

        self.batch = kubernetes.client.BatchV1Api(api_client)
        self.watch = kubernetes.watch.Watch()
        self.full, self.stamps = full, stamps
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="job-watch", daemon=True)

    def start(self) -> None:
        self._version = self.batch.list_namespaced_job(NS, limit=1).metadata.resource_version
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.watch.stream(self.batch.list_namespaced_job, NS, resource_version=self._version,
                                           timeout_seconds=3600):
                obj = event["raw_object"]
                spec, meta = obj.get("spec") or {}, obj.get("metadata") or {}
                if (spec.get("parallelism") or self.full) < self.full:
                    self.stamps.setdefault(meta.get("name"), time.perf_counter())
        except Exception:
            if not self.stopping:
                raise

    def stop(self) -> None:
        """Ends the watch (the control plane going away ends its stream too)."""
        self.stopping = True
        self.watch.stop()


async def fetch(listen: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{listen}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return await response.text()


async def wait_leader(listen: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "spotguard_supervisor_leader 1" in await fetch(listen):
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the supervisor did not become leader")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50, help="managed jobs (issue: 500)")
    parser.add_argument("--pods-per-job", type=int, default=4, help="pods per job (issue: 2,000 pods in all)")
    parser.add_argument("--trials", type=int, default=30, help="notices, one per job (<= jobs)")
    parser.add_argument("--gap", type=float, default=0.5,
                        help="seconds between trials (lets the follow-up writes of the last decision drain)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to let the first full reconcile finish")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--real", action="store_true",
                        help="a real etcd + kube-apiserver from $KUBEBUILDER_ASSETS instead of kmock")
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = asyncio.run(run(args))
    ms = [1000 * x for x in result["latencies"]]
    backend = "real kube-apiserver" if args.real else "kmock"
    print(f"supervisor latency ({backend}): node notice annotation written -> job patched "
          f"({args.jobs} managed jobs, {args.jobs * args.pods_per_job} pods, "
          f"{args.jobs * args.pods_per_job} nodes, {len(ms)} trials)")
    print(f"  p50 {statistics.median(ms):.1f} ms   p99 {percentile(ms, 0.99):.1f} ms   max {max(ms):.1f} ms"
          f"   (goal: p99 <= 250 ms)")
    for line in result["metrics"].splitlines():
        if line.startswith(("spotguard_supervisor_notice_to_patch_seconds_sum",
                            "spotguard_supervisor_notice_to_patch_seconds_count",
                            "spotguard_supervisor_decisions_total")):
            print("  " + line)
    print(f"  wall time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
