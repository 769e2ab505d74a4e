"""The dry-run's kubelet (trainer/cluster/kubelet.py, pod_runner.py) with real processes: what
the supervisor reads from a pod's status (exit code, finishedAt, the termination message), the
environment a container gets (downward API, `$(VAR)`s, volume paths), readiness from the ready
file, the downward-API annotations file, SIGTERM then SIGKILL on deletion, and a node's death or
a container's exit killing every process of the pod, a worker in a session of its own included."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from spotguard.agent.app import Agent
from spotguard.agent.config import AgentConfig
from spotguard.kube.api import NODES, PODS, NotFound
from spotguard.trainer.cluster.admission import inject
from spotguard.trainer.cluster.gc import node_gone
from spotguard.trainer.cluster.kube import LocalKube
from spotguard.trainer.cluster.kubelet import Kubelet, LaunchEpochs

NS = "default"
WAIT = 60.0


@pytest.fixture
async def node(tmp_path):
    """A kubelet on node "n0" with a real (sourceless) agent for its pods' sidecars."""
    secret = tmp_path / "secret"
    secret.write_text("a-shared-secret-of-32-characters")
    agent = Agent(AgentConfig(cloud="aws", node="n0", host="127.0.0.1", port=0, kubernetes=False, gpu="off",
                              report_token_file=str(secret), ready_grace=0.5, log_level="warning"), sources=[])
    address = await agent.start()
    kube = LocalKube()
    kube.admit(PODS, inject)  # the injector's webhook, as in the dry-run's cluster
    kubelet = Kubelet(kube, "n0", run_dir=tmp_path / "run", agent_url=f"http://{address}", report_secret=secret,
                      epochs=LaunchEpochs(), labels={"karpenter.sh/capacity-type": "spot"})
    await kubelet.start()
    try:
        yield kube, kubelet
    finally:
        await kubelet.stop(grace=2.0)
        await agent.stop()


def make_pod(name: str, script: str, **extra) -> dict:
    container = {"name": "trainer", "image": "local", "command": [sys.executable, "-c", script],
                 **extra.pop("container", {})}
    return {"metadata": {"name": name, "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
                         "labels": {"app": "x"}},
            "spec": {"nodeName": "n0", "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                     "containers": [container], **extra}}


async def until(check, what: str, bound: float = WAIT):
    deadline = time.monotonic() + bound
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def text_of(path: str) -> str:
    return Path(path).read_text()


def pod_status(kube: LocalKube, name: str) -> dict:
    return kube.get(PODS, NS, name).get("status") or {}


def terminated(kube: LocalKube, name: str) -> dict | None:
    try:
        statuses = pod_status(kube, name).get("containerStatuses") or []
    except NotFound:
        return None
    return next((s["state"]["terminated"] for s in statuses if "terminated" in s.get("state", {})), None)


async def test_the_node_registers_ready_with_one_gpu(node):
    kube, _ = node
    registered = kube.get(NODES, None, "n0")
    assert registered["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert registered["metadata"]["labels"]["karpenter.sh/capacity-type"] == "spot"
    assert {"type": "Ready", "status": "True"}.items() <= registered["status"]["conditions"][0].items()


async def test_a_drained_container_leaves_its_exit_code_and_termination_message(node):
    kube, _ = node
    script = ("import os, sys\n"
              "open(os.environ['SPOTGUARD_TERMINATION_LOG'], 'w').write('{\"v\":1,\"steps_lost\":2}')\n"
              "sys.exit(83)\n")
    kube.create(PODS, NS, make_pod("drains", script))
    state = await until(lambda: terminated(kube, "drains"), "the exit")
    assert state["exitCode"] == 83 and state["reason"] == "Error" and state["finishedAt"].endswith("Z")
    assert json.loads(state["message"]) == {"v": 1, "steps_lost": 2}
    assert pod_status(kube, "drains")["phase"] == "Failed"
    kube.create(PODS, NS, make_pod("finishes", "pass"))
    assert (await until(lambda: terminated(kube, "finishes"), "the exit"))["exitCode"] == 0
    assert pod_status(kube, "finishes")["phase"] == "Succeeded"


async def test_on_failure_restarts_the_container_in_its_pod_and_keeps_its_last_exit(node, tmp_path):
    kube, _ = node
    count = tmp_path / "runs"
    script = ("import os, sys\n"
              "path = os.environ['COUNT']\n"
              "runs = int(open(path).read()) + 1 if os.path.exists(path) else 1\n"
              "open(path, 'w').write(str(runs))\n"
              "sys.exit(3 if runs == 1 else 0)\n")
    pod = make_pod("retry", script, container={"env": [{"name": "COUNT", "value": str(count)}]})
    pod["spec"]["restartPolicy"] = "OnFailure"
    kube.create(PODS, NS, pod)
    await until(lambda: pod_status(kube, "retry").get("phase") == "Succeeded", "the second run's success")
    (status,) = pod_status(kube, "retry")["containerStatuses"]
    assert status["restartCount"] == 1 and status["lastState"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["exitCode"] == 0


async def test_a_container_gets_the_downward_api_its_variables_its_volume_paths_and_its_sidecar(node, tmp_path):
    """An injected pod (the product's injector at admission): its sidecar runs, on a port of its own
    that the container's `SPOTGUARD_SIDECAR_URL` names, and wrote the hooks token where the
    container's `SPOTGUARD_TOKEN_FILE` points."""
    kube, _ = node
    script = ("import json, os, sys\n"
              "keys = ['INDEX', 'NODE', 'IP', 'RANK_ARG', 'SPOTGUARD_SIDECAR_URL', 'DATA', 'SPOTGUARD_TOKEN_FILE']\n"
              "seen = {k: os.environ.get(k) for k in keys} | {'argv': sys.argv[1:]}\n"
              "json.dump(seen, open(os.environ['OUT'], 'w'))\n")
    out = tmp_path / "env.json"
    pod = make_pod("env", script, container={
        "args": ["--rank=$(INDEX)", "--dir=/data/x"],
        "env": [{"name": "OUT", "value": str(out)},
                {"name": "INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "RANK_ARG", "value": "rank-$(INDEX)-$$(INDEX)"},
                {"name": "DATA", "value": "/data/y"}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/data"}]},
        volumes=[{"name": "scratch", "emptyDir": {}}])
    pod["metadata"]["labels"]["spotguard.io/inject"] = "true"
    kube.create(PODS, NS, pod)
    await until(lambda: terminated(kube, "env"), "the exit")
    seen = json.loads(out.read_text())
    assert (seen["INDEX"], seen["NODE"], seen["IP"], seen["RANK_ARG"]) == ("3", "n0", "127.0.0.1", "rank-3-$(INDEX)")
    assert seen["SPOTGUARD_SIDECAR_URL"].startswith("http://127.0.0.1:")
    assert seen["SPOTGUARD_SIDECAR_URL"] != "http://127.0.0.1:9741"  # the injected port, remapped here
    assert text_of(seen["SPOTGUARD_TOKEN_FILE"])  # the sidecar's hooks token, in the shared volume
    scratch = tmp_path / "run" / "pods" / "env" / "volumes" / "scratch"
    assert seen["DATA"] == f"{scratch}/y" and seen["argv"] == ["--rank=3", f"--dir={scratch}/x"]


async def test_ready_follows_the_ready_file_and_annotations_reach_the_podinfo_file(node, tmp_path):
    kube, _ = node
    script = "import time\ntime.sleep(120)\n"
    pod = make_pod("ready", script, container={
        "readinessProbe": {"exec": {"command": ["test", "-f", "/ready/ready"]}},
        "volumeMounts": [{"name": "r", "mountPath": "/ready"}]}, volumes=[{"name": "r", "emptyDir": {}}])
    kube.create(PODS, NS, pod)
    await until(lambda: pod_status(kube, "ready").get("phase") == "Running", "Running")
    assert not any(c["type"] == "Ready" and c["status"] == "True" for c in pod_status(kube, "ready")["conditions"])
    (tmp_path / "run" / "pods" / "ready" / "volumes" / "r" / "ready").touch()
    await until(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                            for c in pod_status(kube, "ready")["conditions"]), "Ready")
    kube.patch(PODS, NS, "ready", {"metadata": {"annotations": {"spotguard.io/membership": '{"v":1}'}}})
    podinfo = tmp_path / "run" / "pods" / "ready" / "podinfo" / "annotations"
    await until(lambda: podinfo.exists() and 'spotguard.io/membership="{\\"v\\":1}"' in podinfo.read_text(),
                "the annotation in the podinfo file")


def tree_script(parent_ignores_term: bool = False, then: str = "time.sleep(600)\n") -> str:
    """A launcher-like main process whose worker runs in a session of its own (as torchrun's do),
    then does `then`."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if parent_ignores_term else ""
    return ("import os, signal, subprocess, sys, time\n" + ignore +
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            "open(os.environ['OUT'], 'w').write(str(child.pid))\n" + then)


async def worker_pid(out: Path) -> int:
    return int(await until(lambda: out.exists() and out.read_text(), "the worker's pid"))


async def test_a_deleted_pod_gets_sigterm_then_after_its_grace_its_whole_tree_is_killed(node, tmp_path):
    kube, _ = node
    out = tmp_path / "pid"
    kube.create(PODS, NS, make_pod("stubborn", tree_script(parent_ignores_term=True), container={"env": [{"name": "OUT",
                                                                                      "value": str(out)}]}))
    worker = await worker_pid(out)
    started = time.monotonic()
    kube.delete(PODS, NS, "stubborn")
    await until(lambda: not kube.list(PODS, NS)[0], "the pod's deletion")
    assert time.monotonic() - started >= 1.5  # its grace (2 s) before the kill
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


async def test_a_deleted_pods_pre_stop_hook_runs_before_its_sigterm(node, tmp_path):
    kube, _ = node
    marker, seen = tmp_path / "pre-stopped", tmp_path / "seen"
    script = ("import os, signal, sys, time\n"
              "def term(*_):\n"
              "    open(os.environ['SEEN'], 'w').write(str(os.path.exists(os.environ['MARKER'])))\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\n"
              "open(os.environ['SEEN'] + '.ready', 'w').close()\n"
              "time.sleep(600)\n")
    env = [{"name": "MARKER", "value": str(marker)}, {"name": "SEEN", "value": str(seen)}]
    hook = {"preStop": {"exec": {"command": ["python", "-c", f"open({str(marker)!r}, 'w').close()"]}}}
    kube.create(PODS, NS, make_pod("hooked", script, container={"env": env, "lifecycle": hook}))
    await until(lambda: Path(f"{seen}.ready").exists(), "the container")
    kube.delete(PODS, NS, "hooked")
    await until(lambda: seen.exists() and seen.read_text(), "the SIGTERM")
    assert seen.read_text() == "True"  # the hook had run when the container got SIGTERM


async def test_a_dead_node_leaves_no_process_of_its_pods_and_its_pods_fail_as_disrupted(node, tmp_path):
    kube, kubelet = node
    out = tmp_path / "pid"
    kube.create(PODS, NS, make_pod("victim", tree_script(), container={"env": [{"name": "OUT",
                                                                                     "value": str(out)}]}))
    worker = await worker_pid(out)
    killed = await kubelet.die()
    assert list(killed) == ["victim"] and worker in killed["victim"]
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert node_gone(kube, "n0") == ["victim"]
    status = pod_status(kube, "victim")
    assert status["phase"] == "Failed"
    assert any(c["type"] == "DisruptionTarget" and c["reason"] == "DeletionByPodGC" for c in status["conditions"])
    with pytest.raises(NotFound):
        kube.get(NODES, None, "n0")


async def test_a_worker_does_not_outlive_its_containers_main_process(node, tmp_path):
    kube, _ = node
    out = tmp_path / "pid"
    env = {"env": [{"name": "OUT", "value": str(out)}]}
    kube.create(PODS, NS, make_pod("crash", tree_script(then="sys.exit(1)\n"), container=env))
    worker = await worker_pid(out)
    assert (await until(lambda: terminated(kube, "crash"), "the exit"))["exitCode"] == 1
    await until(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE,
                "the worker's end", bound=10)


async def test_a_pods_launcher_and_its_worker_stay_in_the_dry_runs_session(node, tmp_path):
    """A pod's container is a process group of its own in the dry-run's session, and `spotguard
    launch --same-session` keeps its worker there too (the kernel's autogroup scheduling makes
    every session a scheduling group: launch's docstring)."""
    kube, kubelet = node
    out = tmp_path / "out"
    out.mkdir()
    probe = Path(__file__).parent / "workers" / "launch_probe.py"
    kube.create(PODS, NS, make_pod("launch", "", container={"command": [
        sys.executable, "-m", "spotguard", "launch", "--standalone", "--same-session", str(probe), str(out)]}))
    await until(lambda: (out / "rank0.ready").exists(), "the worker")
    launcher = kubelet.pods[kube.get(PODS, NS, "launch")["metadata"]["uid"]].process.pid
    worker = json.loads((out / "rank0.session").read_text())
    assert os.getsid(launcher) == os.getsid(0) and os.getpgid(launcher) == launcher
    assert worker["sid"] == os.getsid(0) and worker["pgid"] == worker["pid"]
    (out / "release").touch()
    assert (await until(lambda: terminated(kube, "launch"), "the exit"))["exitCode"] == 0
