"""A simulated node of the dry-run: one node slot, and on it the current instance (a VM), if any.

An instance is what a cloud VM brings: its own metadata emulator (the cloud as this VM sees
it), the node agent (polling that metadata, with a GPU health source over the fake NVML
backend, marking its Node through the product's `NodeMarker` over the local API), and the
kubelet (trainer/cluster/kubelet.py), which registers the Node (`karpenter.sh/capacity-type`
spot or on-demand) and runs the pods bound to it. All real components on 127.0.0.1 but the GPU.

`start()` boots a new instance; `die()` ends it as a reclaim at its deadline does: every
process of its pods is killed, the agent and the metadata go, the Node is deleted and its pods
fail as disrupted (trainer/cluster/gc.py); `replace_instance()` is the cloud giving the slot
back: a new VM (new boot id, a new agent and its notices' new instance; the old one dies first
if it still lived). `stop(grace)` ends the run: the pods get SIGTERM and `grace` seconds.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.agent.app import Agent
from spotguard.agent.config import AgentConfig
from spotguard.agent.node_marker import NodeMarker
from spotguard.agent.sources.gpu import GpuHealthSource
from spotguard.emulator.control import EmulatorControl
from spotguard.emulator.nvml import FakeGpuBackend
from spotguard.emulator.server import Emulator
from spotguard.trainer.cluster.gc import node_gone
from spotguard.trainer.cluster.kube import LocalKube
from spotguard.trainer.cluster.kubelet import Kubelet, LaunchEpochs

FATAL_XID = 79  # "GPU has fallen off the bus": checkpoint + drain + reboot
CAPACITY_LABEL = "karpenter.sh/capacity-type"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
INSTANCE_TYPE = "dry-run.gpu1"


@dataclass
class Injected:
    """What the emulated cloud was told, and when it started showing it (wall clock)."""

    emulator_id: str | None
    served_at: float | None
    deadline: float | None


@dataclass
class NodeServices:
    """What every node of one run shares: the local API, the run's directory and environment,
    the agents' report secret, the launch epochs."""

    kube: LocalKube
    run_dir: Path
    report_secret: Path
    env: dict[str, str] = field(default_factory=dict)
    epochs: LaunchEpochs = field(default_factory=LaunchEpochs)


@dataclass
class SimulatedNode:
    name: str
    cloud: str
    services: NodeServices
    capacity: str = "spot"  # or "on-demand"
    emulator: Emulator | None = None
    control: EmulatorControl | None = None
    agent: Agent | None = None
    gpu: FakeGpuBackend | None = None
    kubelet: Kubelet | None = None
    maintenance_ids: list[str] = field(default_factory=list)
    instances: int = 0  # instances started so far
    lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock)  # one start / death / stop at a time

    @property
    def alive(self) -> bool:
        return self.kubelet is not None

    def busy(self) -> bool:
        """A container of a pod on this instance still runs."""
        return self.kubelet is not None and any(r.process is not None and r.process.returncode is None
                                                for r in self.kubelet.pods.values())

    async def start(self) -> None:
        """Boots a new instance (see the module docstring)."""
        async with self.lifecycle:
            await self._boot()

    async def _boot(self) -> None:
        s = self.services
        self.instances += 1
        self.emulator = await Emulator(self.cloud).start()
        self.control = EmulatorControl(self.emulator.url, self.emulator.control_token)
        self.gpu = FakeGpuBackend(gpus=1)
        config = AgentConfig(cloud=self.cloud, metadata_url=self.emulator.url, node=self.name, host="127.0.0.1",
                             port=0, kubernetes=False, gpu="off", report_token_file=str(s.report_secret),
                             ready_grace=5.0, log_level="warning")
        self.agent = Agent(config, gpu_source=GpuHealthSource(self.name, backend=self.gpu, interval=0.5),
                           marker=NodeMarker(None, self.name, kube=s.kube, startup_grace=1.0))
        address = await self.agent.start()
        self.kubelet = Kubelet(s.kube, self.name, run_dir=s.run_dir, agent_url=f"http://{address}",
                               report_secret=s.report_secret, epochs=s.epochs, env=s.env,
                               labels={CAPACITY_LABEL: self.capacity, INSTANCE_TYPE_LABEL: INSTANCE_TYPE})
        await self.kubelet.start()

    async def inject(self, kind: str, lead: float | None) -> Injected:
        """Makes the node's cloud (or GPU) announce `kind`; returns when it is served."""
        assert self.control is not None and self.gpu is not None, f"{self.name} has no instance"
        if kind == "gpu-fault":
            self.gpu.xid(0, FATAL_XID)
            now = time.time()
            return Injected(None, now, now)
        emulated_kind, fields = _emulated(self.cloud, kind)
        notice = await self.control.schedule(emulated_kind, in_=0.0, lead=lead, **fields)
        if kind == "maintenance":
            self.maintenance_ids.append(notice["id"])
        served = notice.get("served_at") or time.time()
        return Injected(notice["id"], served, served + (lead if lead is not None else notice["deadline"] - served))

    async def cancel_maintenance(self) -> Injected:
        if not self.maintenance_ids or self.control is None:
            return Injected(None, None, None)
        notice = await self.control.cancel(self.maintenance_ids.pop())
        return Injected(notice["id"], notice.get("canceled_at"), None)

    def live_notices(self) -> list[Any]:
        return list(self.agent.table.live()) if self.agent is not None else []

    async def die(self) -> dict[str, list[int]]:
        """The instance is gone (module docstring); returns the pods whose container still ran,
        each with the PIDs killed then ({} when it had no instance any more)."""
        async with self.lifecycle:
            return await self._die()

    async def _die(self) -> dict[str, list[int]]:
        if self.kubelet is None:
            return {}
        running = await self.kubelet.die()
        self.kubelet = None
        await self._stop_instance()
        node_gone(self.services.kube, self.name)
        return running

    async def replace_instance(self) -> None:
        async with self.lifecycle:
            await self._die()
            await self._boot()

    async def stop(self, grace: float = 10.0) -> None:
        async with self.lifecycle:
            if self.kubelet is not None:
                await self.kubelet.stop(grace)
            await self._stop_instance()

    async def _stop_instance(self) -> None:
        if self.agent is not None:
            try:
                await self.agent.stop()
            except Exception:  # stopping must reach every part
                pass
        if self.control is not None:
            await self.control.close()
        if self.emulator is not None:
            await self.emulator.stop()
        self.emulator = self.control = self.agent = self.gpu = None
        self.maintenance_ids.clear()


def _emulated(cloud: str, kind: str) -> tuple[str, dict[str, Any]]:
    """The emulator's schedule kind and fields for a scenario event on `cloud`."""
    if kind == "reclaim":
        if cloud == "azure":
            return "event", {"event_type": "Preempt"}
        return "reclaim", {}
    if kind == "maintenance":
        if cloud == "azure":
            return "event", {"event_type": "Reboot"}
        if cloud == "alibaba":
            raise ValueError("alibaba shows no maintenance events")
        return "maintenance", {}
    if kind == "rebalance":
        if cloud != "aws":
            raise ValueError(f"{cloud} has no rebalance recommendation (AWS only)")
        return "rebalance", {}
    raise ValueError(f"no emulated form for {kind!r}")


def make_secret(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_urlsafe(32))
    path.chmod(0o600)
    return path
