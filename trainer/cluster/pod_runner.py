"""One pod on one simulated node, as its kubelet runs it (kubelet.py makes one per bound pod).

`run()` carries the pod from bound to finished:
1. the pod's IP is the node's (pods share this host; each has its own ports), the pod's
   directory is made (`<run>/pods/<pod>`: its volumes, its podinfo file, its termination log);
2. its injected sidecar starts (a native sidecar: before the app; sidecar.py runs it here), and
   the downward-API file `podinfo/annotations` holds the pod's annotations (`key="value"` lines,
   replaced atomically whenever they change: `observe`);
3. the one app container starts as a local process (container.py: its environment, its
   `$(VAR)`s, its paths), in a process group of its own, every process of it carrying the pod's
   marker (`reaper.POD_ENV`); the status says Running, Ready once its readiness file exists;
4. when the main process exits, every other process of the pod is killed (a container's
   processes end with its PID 1), and the status records the exit: `exitCode` (128 + signal
   for a signal), `finishedAt`, `reason`, and the termination message (the file the container
   knows as `SPOTGUARD_TERMINATION_LOG`, at most 4096 bytes); phase Succeeded / Failed
   (`restartPolicy: OnFailure` restarts a failed container in the pod instead);
5. `terminate(grace)` (the pod was deleted): the container's preStop hook (the injected
   `spotguard sidecar prestop`: it holds while a checkpoint is being made), then SIGTERM to the
   main process, and once `grace` seconds have passed since the deletion SIGKILL to all of the
   pod's processes; the pod is then deleted for good.
`kill()` (the node died): every process of the pod is killed at once and nothing more is
written (a dead node's kubelet writes nothing).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.hooks.sidecar.service import Sidecar
from spotguard.kube.api import PODS, NotFound
from spotguard.processes import die_with_parent
from spotguard.trainer.cluster import container as spec
from spotguard.trainer.cluster.kube import rfc3339
from spotguard.trainer.cluster.sidecar import PortMap, sidecar_config, sidecar_container, write_service_account_tokens
from spotguard.trainer.reaper import POD_ENV, dump_stacks, kill_marked
from spotguard.wire import names

if TYPE_CHECKING:
    from spotguard.trainer.cluster.kubelet import Kubelet

log = logging.getLogger(__name__)
MAX_MESSAGE = 4096


def downward_annotations(pod: Mapping[str, Any]) -> str:
    """The downward API's `annotations` file: `key="value"` lines, sorted by key."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return "".join(f"{k}={json.dumps(str(v))}\n" for k, v in sorted(annotations.items()))


LOG_DIR = "logs"  # under the run directory: each pod's container output, one file per pod


def container_log(pod: str) -> str:
    """Where the container of pod `pod` writes its output, relative to the run directory."""
    return f"{LOG_DIR}/{pod}.log"


def exit_status(returncode: int) -> int:
    """A container's exit code: the process's, or 128 + the signal that ended it."""
    return 128 - returncode if returncode < 0 else returncode


class PodRunner:
    """See the module docstring."""

    def __init__(self, kubelet: Kubelet, pod: dict):
        self.kubelet = kubelet
        self.pod = pod
        self.name, self.namespace, self.uid = pod["metadata"]["name"], pod["metadata"]["namespace"], \
            pod["metadata"]["uid"]
        self.dir = kubelet.run_dir / "pods" / self.name
        containers = (pod.get("spec") or {}).get("containers") or []
        if len(containers) != 1:
            raise ValueError(f"pod {self.name}: the local kubelet runs pods of exactly one container")
        self.container = containers[0]
        self.sidecar_spec = sidecar_container(pod)
        self.volumes = spec.Volumes(pod, self.container, self.dir, kubelet.run_dir / "claims")
        self.ports = PortMap(0, 0)  # the sidecar's port as the pod knows it -> where it listens here
        self.env: dict[str, str] = {}
        self.ready_file = spec.ready_file(self.container, self.volumes)
        self.process: asyncio.subprocess.Process | None = None
        self.sidecar: Sidecar | None = None
        self.ready = False
        self.restarts = 0
        self.dead = False  # the node died: nothing more is written
        self.deleting = False
        self.done = asyncio.Event()
        self._annotations = ""
        self._last_state: dict = {}

    @property
    def termination_log(self) -> Path:
        return self.dir / "termination-log"

    # ---- the kubelet's calls -------------------------------------------------------------------
    def observe(self, pod: dict) -> None:
        """The pod as the API has it now: its annotations reach the podinfo file."""
        self.pod = pod
        if not self.dead:
            self._write_podinfo()

    def probe(self) -> bool | None:
        """The readiness probe: the new value when it changed (the kubelet writes it), else None."""
        running = self.process is not None and self.process.returncode is None
        ready = running and (self.ready_file is None or self.ready_file.exists())
        if ready == self.ready:
            return None
        self.ready = ready
        return ready

    async def terminate(self, grace: float) -> None:
        """The pod was deleted (module docstring; a pod whose container had ended already is
        deleted for good at once)."""
        self.deleting = True
        if self.done.is_set():
            if not self.dead:
                self._delete()
            return
        until = time.monotonic() + max(0.0, grace)
        await self._pre_stop(until)
        process = self.process
        if process is not None and process.returncode is None:
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(process.wait(), max(0.0, until - time.monotonic()))
            except TimeoutError:
                log.warning("pod %s: still running %.0fs after its deletion: killing it", self.name, grace)
        await self.kill()

    async def _pre_stop(self, until: float) -> None:
        """Runs the container's preStop exec hook (bounded by the grace period)."""
        hook = ((self.container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
        if not hook or self.process is None or self.process.returncode is not None:
            return
        command = spec.argv({"name": "preStop", "command": hook.get("command")}, self.env, self.volumes)
        try:
            done = await asyncio.create_subprocess_exec(*[self.ports.rewrite(w) for w in command], env=self.env,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.DEVNULL)
            await asyncio.wait_for(done.wait(), max(0.0, until - time.monotonic()))
        except TimeoutError:
            done.kill()
        except OSError as exc:
            log.warning("pod %s: its preStop hook did not run: %s", self.name, exc)

    async def dump_stacks(self) -> list[int]:
        """The pod's processes that can say where their threads are do so in its log (PIDs); not
        the container's main process, a launcher that would forward the signal to every worker."""
        main = (self.process.pid,) if self.process is not None else ()
        return await asyncio.to_thread(dump_stacks, self.uid, POD_ENV, main)

    async def kill(self) -> list[int]:
        """Every process of the pod, killed now (PIDs)."""
        return await asyncio.to_thread(kill_marked, self.uid, POD_ENV)

    # ---- the pod's life ------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._prepare()
            while True:
                code = await self._run_container()
                if self.dead:
                    return
                message = self._termination_message()
                restart = (self.pod.get("spec") or {}).get("restartPolicy") == "OnFailure"
                if restart and code != 0 and not self.deleting:
                    self._last_state = {"terminated": self._terminated(code, message)}
                    self.restarts += 1
                    continue
                self._write_status(self._finished_status(code, message))
                break
        except Exception:
            log.exception("pod %s: the local kubelet could not run it", self.name)
            if not self.dead:
                self._write_status({"phase": "Failed", "reason": "KubeletError"})
        finally:
            await self._stop_sidecar()
            if self.deleting and not self.dead:
                self._delete()
            self.done.set()

    async def _prepare(self) -> None:
        self._write_status({"podIP": self.kubelet.ip, "hostIP": self.kubelet.ip})  # the sandbox's address
        self.volumes.create()
        (self.dir / "podinfo").mkdir(parents=True, exist_ok=True)
        self.termination_log.unlink(missing_ok=True)
        write_service_account_tokens(self.pod, self.dir, self.kubelet.report_secret.read_text())
        self._write_podinfo()
        if self.sidecar_spec is not None:
            volumes = spec.Volumes(self.pod, self.sidecar_spec, self.dir, self.kubelet.run_dir / "claims")
            volumes.create()
            config, pod_port = sidecar_config(self.pod, self.sidecar_spec, volumes, self.kubelet.agent_url)
            self.sidecar = Sidecar(config)
            await self.sidecar.start()
            self.ports = PortMap(pod_port, int(self.sidecar.url.rsplit(":", 1)[1]))

    async def _run_container(self) -> int:
        self.env = env = self._environment()
        command = [self.ports.rewrite(w) for w in spec.argv(self.container, env, self.volumes)]
        log_path = self.kubelet.run_dir / container_log(self.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        out = await asyncio.to_thread(open, log_path, "ab")
        with out:
            self.process = await asyncio.create_subprocess_exec(
                *command, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                cwd=str(self.dir), process_group=0, preexec_fn=die_with_parent(signal.SIGTERM))
        log.info("pod %s: container started on %s (pid %d)", self.name, self.kubelet.node, self.process.pid)
        self.ready = False
        self._write_status(self._running_status(started))
        try:
            returncode = await self.process.wait()
            await self.kill()  # the container's other processes end with its main one
        finally:
            self.kubelet.epochs.ended(self.pod, self.uid)
        return exit_status(returncode)

    def _environment(self) -> dict[str, str]:
        """The container's variables (container.py) over this host's, the kubelet's own: the file
        the container knows as /dev/termination-log, and the dry-run's plumbing (its event log,
        its launch epoch, the pod's marker)."""
        epoch = self.kubelet.epochs.started(self.pod, self.uid)
        extra = {**os.environ, **self.kubelet.env, "PYTHONUNBUFFERED": "1",
                 names.ENV_TERMINATION_LOG: str(self.termination_log),
                 "SPOTGUARD_EVENT_LOG": str(self.kubelet.run_dir / "events" / f"{self.name}.jsonl"),
                 "SPOTGUARD_GENERATION": str(epoch), POD_ENV: self.uid}
        env = spec.container_env(self.pod, self.container, self.volumes, extra)
        return {k: self.ports.rewrite(v) for k, v in env.items()}

    # ---- what the kubelet writes ---------------------------------------------------------------
    def _write_podinfo(self) -> None:
        text = downward_annotations(self.pod)
        if text == self._annotations:
            return
        folder = self.dir / "podinfo"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".annotations.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / "annotations")
        self._annotations = text

    def _termination_message(self) -> str:
        try:
            return self.termination_log.read_bytes()[:MAX_MESSAGE].decode(errors="replace")
        except OSError:
            return ""

    def _terminated(self, code: int, message: str) -> dict:
        state = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": rfc3339()}
        if message:
            state["message"] = message
        return state

    def _container_status(self, state: dict, ready: bool) -> dict:
        return {"name": self.container.get("name", "main"), "ready": ready, "restartCount": self.restarts,
                "started": "running" in state, "state": state, "lastState": self._last_state,
                "image": self.container.get("image", ""), "containerID": f"local://{self.process.pid}"
                if self.process is not None else ""}

    def _running_status(self, started: float) -> dict:
        return {"phase": "Running", "podIP": self.kubelet.ip, "hostIP": self.kubelet.ip,
                "startTime": (self.pod.get("status") or {}).get("startTime") or rfc3339(started),
                "conditions": self._conditions(False),
                "containerStatuses": [self._container_status({"running": {"startedAt": rfc3339(started)}}, False)]}

    def _finished_status(self, code: int, message: str) -> dict:
        return {"phase": "Succeeded" if code == 0 else "Failed", "conditions": self._conditions(False),
                "containerStatuses": [self._container_status({"terminated": self._terminated(code, message)},
                                                             False)]}

    def ready_status(self, ready: bool) -> dict:
        statuses = [dict(s, ready=ready) for s in (self.pod.get("status") or {}).get("containerStatuses") or []]
        return {"conditions": self._conditions(ready), "containerStatuses": statuses}

    def _conditions(self, ready: bool) -> list[dict]:
        kept = [c for c in (self.pod.get("status") or {}).get("conditions") or []
                if c.get("type") not in ("Initialized", "ContainersReady", "Ready")]
        now, value = rfc3339(), "True" if ready else "False"
        return [*kept, {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
                {"type": "Ready", "status": value, "lastTransitionTime": now}]

    def _write_status(self, status: dict) -> None:
        try:
            self.pod = self.kubelet.kube.patch(PODS, self.namespace, self.name, {"status": status}, status=True)
        except NotFound:
            pass

    def _delete(self) -> None:
        try:
            self.kubelet.kube.delete(PODS, self.namespace, self.name, grace_seconds=0)
        except NotFound:
            pass

    async def _stop_sidecar(self) -> None:
        if self.sidecar is not None:
            try:
                await self.sidecar.stop()
            except Exception:  # stopping must not keep the pod from finishing
                log.exception("pod %s: its sidecar did not stop cleanly", self.name)
            self.sidecar = None
