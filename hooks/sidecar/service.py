"""The sidecar assembled: relay -> live set -> stream/prestop/topology, hooks -> book -> reporter.

`Sidecar(config)` is used as `async with Sidecar(config) as sc:` (or `start()`/`stop()`); it
checks the configuration first (ConfigError naming the flag: unreadable or malformed hostfile,
bad elasticity block, unusable token file), then writes a fresh random token to
`config.token_file` (mode 0600, atomically, so a reader never sees half a token), binds the
HTTP API (`url` is then the bound address) and starts the relay, the membership watcher and
the reporter as tasks. `stop()` ends streams and tasks and removes nothing else.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass

from aiohttp import web

from spotguard.config import ConfigError
from spotguard.hooks.hostfile import (ElasticityError, ElasticRule, Host, HostfileError,
                                      elastic_rule_from_config, read_hostfile, write_atomic)
from spotguard.hooks.sidecar.broadcast import Broadcaster, Pulse
from spotguard.hooks.sidecar.membership import AnnotationWatcher
from spotguard.hooks.sidecar.prestop import HookBook, Progress
from spotguard.hooks.sidecar.relay import Relay
from spotguard.hooks.sidecar.reporter import Reporter, ReportPlanner
from spotguard.hooks.sidecar.server import SidecarAPI
from spotguard.hooks.sidecar.topology import Topology
from spotguard.http_server import ServerLimits, start_server
from spotguard.wire import names, notice_policy
from spotguard.wire.hook_report import HookReport
from spotguard.wire.live import Change, LiveSet
from spotguard.wire.membership import Membership
from spotguard.wire.notice import Kind, Notice, now_utc
from spotguard.wire.notice import notice_id as notice_id_of
from spotguard.wire.snapshot import snapshot_wire

log = logging.getLogger(__name__)

DRAIN_SOURCE = names.SUPERVISOR_DRAIN_SOURCE  # the source of drain notices the supervisor asks for by membership


@dataclass
class SidecarConfig:
    agent_url: str
    token_file: str
    listen_host: str = "127.0.0.1"
    listen_port: int = names.SIDECAR_PORT
    agent_token_file: str | None = None
    podinfo_dir: str | None = None
    hostfile: str | None = None
    deepspeed_config: str | None = None
    local_world_size: int | None = None
    pod: str = "unknown"
    namespace: str = "default"
    podinfo_interval: float = 1.0
    keepalive: float = 10.0
    header_timeout: float = 10.0
    max_streams: int = 256
    agent_idle_timeout: float = 35.0
    report_give_up: float = 120.0
    horizon_seconds: float = notice_policy.HORIZON_SECONDS  # the Guard's: a notice further ahead is held


def load_topology_inputs(config: SidecarConfig) -> tuple[list[Host] | None, ElasticRule | None]:
    """Reads the hostfile and the elasticity rule (blocking); ConfigError names the flag."""
    hosts = rule = None
    if config.hostfile is not None:
        try:
            hosts = read_hostfile(config.hostfile)
        except HostfileError as exc:
            raise ConfigError("--hostfile", str(exc)) from None
        except OSError as exc:
            raise ConfigError("--hostfile", f"cannot read {config.hostfile}: {exc.strerror or exc}") from None
    if config.deepspeed_config is not None:
        try:
            rule = elastic_rule_from_config(config.deepspeed_config)
        except ElasticityError as exc:
            raise ConfigError("--deepspeed-config", str(exc)) from None
        if rule is not None and hosts is None:
            log.warning("--deepspeed-config has an elasticity block but no --hostfile is given: nothing to trim")
    return hosts, rule


def write_token(path: str) -> str:
    """Writes a fresh random token to `path` with mode 0600 (blocking) and returns it."""
    token = secrets.token_urlsafe(32)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, token.encode() + b"\n", mode=0o600)
    except OSError as exc:
        raise ConfigError("--token-file", f"cannot write {path}: {exc.strerror or exc}") from None
    return token


class Sidecar:
    """One training pod's sidecar. Single event loop; not thread-safe."""

    def __init__(self, config: SidecarConfig):
        self.config = config
        self.live = LiveSet()
        self.pulse = Pulse()
        self.broadcaster = Broadcaster()
        self.book = HookBook(config.local_world_size, self.pulse)
        self.planner = ReportPlanner(config.pod, config.namespace)
        self.reporter = Reporter(config.agent_url, config.agent_token_file, give_up_after=config.report_give_up)
        self.relay = Relay(config.agent_url, self._on_relay_change, self.live, idle_timeout=config.agent_idle_timeout)
        self.topology = Topology(self._on_membership, horizon_seconds=config.horizon_seconds)
        self.watcher: AnnotationWatcher | None = None
        self.token = ""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Sidecar:
        cfg = self.config
        hosts, rule = await asyncio.to_thread(load_topology_inputs, cfg)
        if hosts is not None:
            self.topology = Topology(self._on_membership, cfg.hostfile, hosts, rule,
                                     horizon_seconds=cfg.horizon_seconds)
        self.token = await asyncio.to_thread(write_token, cfg.token_file)
        await self.topology.update()
        api = SidecarAPI(self, cfg.keepalive, max_streams=cfg.max_streams, body_timeout=cfg.header_timeout)
        try:
            self._runner, host, port = await start_server(api.make_app(), cfg.listen_host, cfg.listen_port,
                                                          ServerLimits(header_timeout=cfg.header_timeout),
                                                          shutdown_timeout=1.0)
        except OSError as exc:
            raise ConfigError(
                "--listen", f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: {exc.strerror or exc}") from None
        self.url = f"http://{host}:{port}"
        self._tasks = [asyncio.create_task(self.relay.run(), name="sidecar-relay"),
                       asyncio.create_task(self.reporter.run(), name="sidecar-reporter")]
        if cfg.podinfo_dir is not None:
            self.watcher = AnnotationWatcher(cfg.podinfo_dir, self._on_annotation, cfg.podinfo_interval)
            await self.watcher.check()
            self._tasks.append(asyncio.create_task(self.watcher.run(), name="sidecar-membership"))
        log.info("sidecar listening", extra={"url": self.url, "agent": cfg.agent_url})
        return self

    async def stop(self) -> None:
        self.broadcaster.close()
        self.topology.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 5)
            except (TimeoutError, asyncio.CancelledError):
                pass
        self._tasks = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Sidecar:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def record_hook(self, report: HookReport) -> Progress:
        """Books a rank's hook report and queues any agent report it completes."""
        progress = self.book.record(report)
        body = self.planner.plan(progress)
        if body is not None:
            if self.live.seen(report.notice_id):
                self.reporter.submit(body)
            else:
                log.info("not reporting %s to the agent: not one of its notices", report.notice_id)
        return progress

    def snapshot_wire(self) -> dict:
        """The sidecar's snapshot: its live set, complete once the agent's was."""
        return snapshot_wire(self.live.node, self.live.notices(), self.live.complete)

    async def _on_relay_change(self, changes: list[Change]) -> None:
        for change in changes:
            if change.resync:  # subscribers that got an incomplete snapshot learn what is gone
                self.broadcaster.publish("snapshot", self.snapshot_wire())
            else:
                self.broadcaster.publish(*change.to_event())
        self.pulse.notify()
        try:
            await self.topology.set_notices(self.live.notices())
        except Exception:  # a topology problem must not stop the relay
            log.exception("updating the membership after a notice change failed")

    async def _on_annotation(self, membership: Membership) -> None:
        await self.topology.set_membership(membership)
        await self._on_relay_change(self.live.set_local(self._drain_notices(membership)))

    def _drain_notices(self, membership: Membership) -> list[Notice]:
        """The supervisor's drain request as a `drain` notice for the pod's ranks (kept with the
        time it was first seen, so a re-read of the annotation changes nothing)."""
        if not membership.drain:
            return []
        notice_id = notice_id_of(DRAIN_SOURCE, self.config.pod or "pod", membership.drain)
        held = self.live.get(notice_id)
        if held is not None:
            return [held]
        return [Notice(notice_id, Kind.DRAIN, DRAIN_SOURCE, self.live.node or self.config.pod or "unknown",
                       now_utc(), None, {"request": membership.drain})]

    async def _on_membership(self, data: dict) -> None:
        self.broadcaster.publish("membership", data)
