"""Bench: `spotguard status` listing N managed jobs (default 500) on a real kube-apiserver.

Starts etcd + kube-apiserver from $KUBEBUILDER_ASSETS through tests/control_plane.py (no
controllers: the Jobs are created suspended, so nothing else writes to them), creates N managed
Indexed Jobs, each with a decision record and a steps-lost annotation as the supervisor writes
them, then measures, over `--trials` runs each:
- `list`: the command's own work in this process (the list of Jobs and of PyTorchJobs, one row
  per job, the table), what `spotguard status` spends once started, through its plain HTTPS
  reader (`spotguard.kube.rest`); `official`: the same through the official `kubernetes` client;
- `command` / `plugin`: the whole command as a user runs it (`spotguard status --kubeconfig ...`
  / `kubectl-spotguard status ...` in a new process: Python's start and the imports included,
  which no longer include the `kubernetes` package), wall time and the CPU time it used (the wall
  time of a loaded machine says little; the CPU time is what an idle one would need at least).
Prints min / median / max.

    KUBEBUILDER_ASSETS=... .venv/bin/python bench/status_list.py            # 500 jobs, 5 trials
    KUBEBUILDER_ASSETS=... .venv/bin/python bench/status_list.py --jobs 100 --trials 3
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RECORD = {"v": 1, "phase": "Running", "event": "SpotguardScaled", "reason": "NoticeScaledDown",
          "message": "notice r1 on n2: scaling from 4 to the 3 replicas on unaffected nodes",
          "decided_at": "2026-11-25T21:55:00Z", "reclaims_survived": 1, "replicas": 3, "handled": ["r1"],
          "cost": {"spot_hours": 12.5, "on_demand_hours": 0.0, "cost": 12.5, "on_demand_equivalent": 37.5}}


def job(name: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {"spotguard.io/managed": "true"},
                         "annotations": {"spotguard.io/policy": "elastic", "spotguard.io/min-replicas": "2",
                                         "spotguard.io/status": json.dumps(RECORD), "spotguard.io/steps-lost": "0"}},
            "spec": {"parallelism": 4, "completions": 4, "completionMode": "Indexed", "suspend": True,
                     "template": {"spec": {"restartPolicy": "Never",
                                           "containers": [{"name": "train", "image": "train:1",
                                                           "resources": {"requests": {"nvidia.com/gpu": "1"},
                                                                         "limits": {"nvidia.com/gpu": "1"}}}]}}}}


def summary(name: str, values: list[float]) -> str:
    return (f"{name:8s} min {min(values) * 1000:7.1f} ms   median {statistics.median(values) * 1000:7.1f} ms   "
            f"max {max(values) * 1000:7.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--namespace", default="bench-status")
    args = parser.parse_args(argv)

    import kubernetes

    from spotguard.kube.api import Kube
    from spotguard.supervisor import status_cli
    from tests.control_plane import assets_dir, start_control_plane

    if assets_dir() is None:
        print("set KUBEBUILDER_ASSETS to the control plane's bin folder (make k8s-assets)", file=sys.stderr)
        return 2
    plane = start_control_plane(False)
    try:
        core = kubernetes.client.CoreV1Api(plane.api_client())
        core.create_namespace({"metadata": {"name": args.namespace}})
        batch = kubernetes.client.BatchV1Api(plane.api_client())
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: batch.create_namespaced_job(args.namespace, job(f"train-{i:04d}")),
                          range(args.jobs)))
        print(f"created {args.jobs} managed jobs in {time.monotonic() - started:.1f}s")
        kubeconfig = str(plane.kubeconfig())

        readers = {"list": status_cli.reader,  # what the command uses: plain HTTPS GETs
                   "official": lambda ns: Kube(status_cli.api_client(ns))}  # the official client, for comparison
        in_process: dict[str, list[float]] = {name: [] for name in readers}
        p = argparse.ArgumentParser()
        status_cli.add_arguments(p)
        ns = p.parse_args(["--kubeconfig", kubeconfig])
        for _ in range(args.trials):
            for name, make in readers.items():
                out = io.StringIO()
                t0 = time.perf_counter()
                rows = status_cli.list_rows(make(ns), None)
                with redirect_stdout(out):
                    sys.stdout.write(status_cli.render(rows, "table", status_cli.now_utc()))
                in_process[name].append(time.perf_counter() - t0)
                if len(rows) != args.jobs:
                    print(f"{name}: listed {len(rows)} jobs, expected {args.jobs}", file=sys.stderr)
                    return 1

        entry_points = {"command": [sys.executable, "-m", "spotguard", "status"],
                        "plugin": [str(Path(sys.executable).parent / "kubectl-spotguard"), "status"]}
        walls: dict[str, list[float]] = {name: [] for name in entry_points}
        cpus: dict[str, list[float]] = {name: [] for name in entry_points}
        for _ in range(args.trials):
            for name, program in entry_points.items():
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                result = subprocess.run([*program, "--kubeconfig", kubeconfig], capture_output=True, text=True,
                                        timeout=120)
                walls[name].append(time.perf_counter() - t0)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
                lines = result.stdout.count("\n")
                if result.returncode != 0 or lines != args.jobs + 1:
                    print(f"{name} failed ({result.returncode}, {lines} lines): {result.stderr}", file=sys.stderr)
                    return 1
        print(f"spotguard status, {args.jobs} managed jobs, real kube-apiserver, {args.trials} trials "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
        print(summary("list", in_process["list"]) + "   (in process: API lists + rows + table, plain reader)")
        print(summary("official", in_process["official"]) + "   (the same through the official kubernetes client)")
        for name in entry_points:
            print(summary(name, walls[name]) + f"   cpu median {statistics.median(cpus[name]) * 1000:7.1f} ms"
                  + ("   (spotguard status: new process)" if name == "command" else "   (kubectl-spotguard status)"))
        return 0
    finally:
        plane.stop()


if __name__ == "__main__":
    raise SystemExit(main())
