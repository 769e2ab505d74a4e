"""Wires the supervisor together: API client, Lease election, controller, metrics server.

`run_supervisor(options, stop, announce)` runs until `stop` is set: it serves /metrics and
/healthz, campaigns for the Lease, and runs the controller (which acts only while leader).
On stop it releases the Lease so a standby replica takes over at once.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from collections.abc import Callable

from aiohttp import web

from spotguard.supervisor.controller import Controller, ControllerConfig
from spotguard.supervisor.cost import CostLedger, PriceTable
from spotguard.kube.api import Kube
from spotguard.supervisor.leader import LeaderElector
from spotguard.supervisor.metrics import SupervisorMetrics, metrics_app
from spotguard.supervisor.policy import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    """Validated settings of `spotguard supervisor` (see cli.py for each flag)."""

    kubeconfig: str | None = None
    kube_host: str | None = None
    namespace: str | None = None
    lease_namespace: str = "default"
    lease_name: str = "spotguard-supervisor"
    identity: str = "spotguard-supervisor"
    listen_host: str = "0.0.0.0"
    listen_port: int = 9742
    prices: PriceTable | None = None
    resync: float = 60.0
    lease_duration: float = 15.0
    checkpoint_timeout: float = 120.0
    scale_out_delay: float = 30.0
    membership_hosts: str = "node"
    workers: int = 4


async def run_supervisor(options: Options, stop: asyncio.Event, announce: Callable[[str], None] | None = None) -> None:
    from spotguard.kube import load_api_client

    api_client = load_api_client(options.kubeconfig, options.kube_host)
    kube = Kube(api_client)
    metrics = SupervisorMetrics()
    config = ControllerConfig(identity=options.identity, namespace=options.namespace,
                              settings=Settings(options.checkpoint_timeout, options.scale_out_delay),
                              resync=options.resync, workers=options.workers, membership_hosts=options.membership_hosts)
    controller_ref: list[Controller] = []

    def on_leadership(leader: bool) -> None:
        if controller_ref:  # the controller exists once the elector does (it is built next)
            controller_ref[0].on_leadership(leader)

    elector = LeaderElector(kube, options.lease_namespace, options.lease_name, options.identity,
                            lease_duration=options.lease_duration, on_change=on_leadership)
    controller = Controller(kube, config, elector=elector, metrics=metrics, ledger=CostLedger(options.prices))
    controller_ref.append(controller)

    runner = web.AppRunner(metrics_app(metrics), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, options.listen_host, options.listen_port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    address = (
        "{}:{}".format(*sockets[0].getsockname()[:2]) if sockets else f"{options.listen_host}:{options.listen_port}"
    )
    election_stop = asyncio.Event()
    election = None
    try:
        await controller.start()
        election = asyncio.create_task(elector.run(election_stop), name="supervisor-election")
        if announce is not None:
            announce(address)
        await stop.wait()
    finally:
        election_stop.set()
        if election is not None:
            await asyncio.wait({election}, timeout=10)
        await controller.stop()
        await runner.cleanup()
        api_client.close()
