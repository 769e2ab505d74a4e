"""A simulated node for the dry-run: its cloud metadata, its agent, its training pod's sidecar.

Each node has its own metadata emulator (the cloud as this VM sees it), a node agent in local
mode (`--no-kubernetes`) polling it, a GPU health source over the fake NVML backend, and one
sidecar relaying the agent's stream to the node's training rank. All of them are the real
components, served over real sockets on 127.0.0.1; only the GPU is fake.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.agent.app import Agent
from spotguard.agent.config import AgentConfig
from spotguard.emulator.nvml import FakeGpuBackend
from spotguard.agent.sources.gpu import GpuHealthSource
from spotguard.emulator.control import EmulatorControl
from spotguard.emulator.server import Emulator
from spotguard.hooks.sidecar.service import Sidecar, SidecarConfig
from spotguard.wire import names
from spotguard.wire.membership import Membership

FATAL_XID = 79  # "GPU has fallen off the bus": checkpoint + drain + reboot


@dataclass
class Injected:
    """What the emulated cloud was told, and when it started showing it (wall clock)."""

    emulator_id: str | None
    served_at: float | None
    deadline: float | None


@dataclass
class SimulatedNode:
    name: str
    cloud: str
    run_dir: Path
    emulator: Emulator | None = None
    control: EmulatorControl | None = None
    agent: Agent | None = None
    sidecar: Sidecar | None = None
    gpu: FakeGpuBackend | None = None
    maintenance_ids: list[str] = field(default_factory=list)
    rdzv_port: int = 0  # the rendezvous port of this node's training pod (in-place jobs)

    @property
    def podinfo_dir(self) -> Path:
        """The node's "downward-API volume": the supervisor's membership annotation."""
        return self.run_dir / "nodes" / self.name / "podinfo"

    @property
    def ready_file(self) -> Path:
        """What a joiner on this node creates once ready (the readiness probe's file)."""
        return self.run_dir / "nodes" / self.name / "ready"

    def push_membership(self, membership: Membership) -> None:
        """Writes the membership annotation the way the kubelet would (atomic rename; blocking)."""
        self.podinfo_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.podinfo_dir / ".annotations.tmp"
        tmp.write_text(f"{names.ANN_MEMBERSHIP}={json.dumps(membership.to_json())}\n")
        os.replace(tmp, self.podinfo_dir / "annotations")

    @property
    def sidecar_url(self) -> str:
        return self.sidecar.url

    @property
    def token_file(self) -> Path:
        return self.run_dir / "nodes" / self.name / "hooks-token"

    async def start(self, report_secret_file: Path) -> None:
        node_dir = self.run_dir / "nodes" / self.name
        node_dir.mkdir(parents=True, exist_ok=True)
        self.podinfo_dir.mkdir(parents=True, exist_ok=True)
        self.emulator = await Emulator(self.cloud).start()
        self.control = EmulatorControl(self.emulator.url, self.emulator.control_token)
        self.gpu = FakeGpuBackend(gpus=1)
        config = AgentConfig(cloud=self.cloud, metadata_url=self.emulator.url, node=self.name, host="127.0.0.1",
                             port=0, kubernetes=False, gpu="off", report_token_file=str(report_secret_file),
                             ready_grace=5.0, log_level="warning")
        gpu_source = GpuHealthSource(self.name, backend=self.gpu, interval=0.5)
        self.agent = Agent(config, gpu_source=gpu_source)
        address = await self.agent.start()
        self.sidecar = Sidecar(SidecarConfig(agent_url=f"http://{address}", token_file=str(self.token_file),
                                             listen_port=0, agent_token_file=str(report_secret_file),
                                             local_world_size=1, pod=f"train-{self.name}",
                                             podinfo_dir=str(self.podinfo_dir), podinfo_interval=0.1))
        await self.sidecar.start()

    async def inject(self, kind: str, lead: float | None) -> Injected:
        """Makes the node's cloud (or GPU) announce `kind`; returns when it is served."""
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
        if not self.maintenance_ids:
            return Injected(None, None, None)
        notice = await self.control.cancel(self.maintenance_ids.pop())
        return Injected(notice["id"], notice.get("canceled_at"), None)

    async def replace_instance(self, report_secret_file: Path) -> None:
        """The node comes back as a new instance: fresh metadata, agent, GPU and sidecar."""
        await self.stop()
        self.emulator = self.control = self.agent = self.sidecar = self.gpu = None
        self.maintenance_ids.clear()
        await self.start(report_secret_file)

    def live_notices(self) -> list[Any]:
        return list(self.agent.table.live()) if self.agent is not None else []

    async def stop(self) -> None:
        for part in (self.sidecar, self.agent):
            if part is not None:
                try:
                    await part.stop()
                except Exception:  # stopping must reach every part
                    pass
        if self.control is not None:
            await self.control.close()
        if self.emulator is not None:
            await self.emulator.stop()


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
