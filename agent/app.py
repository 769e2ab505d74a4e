"""The node agent, wired: sources -> notice table -> (HTTP server, node marker, metrics).

Contract:
- `Agent(config, sources=None, ...)`; `await agent.start()` builds what was not injected
  (cloud sources, GPU source, Kubernetes client, node source, marker, report authentication),
  binds the server (`agent.address` is the bound "host:port"), and starts one task per source.
  Problems with the configuration raise ConfigError before anything runs.
- Each source feeds the table under its own origin; a source whose loop breaks is logged and
  restarted with backoff: no loop dies for good, and publishing never waits on Kubernetes.
- Ready (`/readyz`) once every source has had one successful read (or has ended), or
  `config.ready_grace` seconds passed. The marker gets the live set first at readiness (so a
  restarted agent does not wipe the marks of a notice its sources have not re-read yet), then
  after every change.
- Complete once every source has had one successful read (or has ended), never by a grace:
  until then the table is not authoritative, and the stream's snapshots say so (`complete:
  false`), so no consumer takes a notice missing from them for withdrawn.
- `await agent.stop()` (what SIGTERM does): stops the sources, ends every stream cleanly,
  stops the marker without removing marks, closes the server and the Kubernetes client.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from spotguard.agent.auth import Authenticator, RefuseAll, SharedSecretAuth, TokenReviewAuth
from spotguard.agent.config import AgentConfig
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reports import ReportBook
from spotguard.agent.server import AgentServer
from spotguard.agent.sources.base import Source
from spotguard.agent.table import NoticeTable, Published
from spotguard.backoff import Backoff
from spotguard.config import ConfigError
from spotguard.http_server import ServerLimits, start_server
from spotguard.wire import names
from spotguard.kube.api import PODS, Kube

log = logging.getLogger(__name__)

class Agent:
    """See the module docstring. Optional arguments replace what `start()` would build."""

    def __init__(self, config: AgentConfig, sources: list[Source] | None = None, *,
                 api_client: Any = None, marker: Any = None, authenticator: Authenticator | None = None,
                 gpu_source: Source | None = None):
        self.config = config
        self.sources: list[Source] = list(sources) if sources is not None else []
        self._build_cloud_sources = sources is None
        self.api_client = api_client
        self.marker = marker
        self.authenticator = authenticator
        self.gpu_source = gpu_source
        self.table = NoticeTable(config.node)
        self.metrics = AgentMetrics()
        self.origins: dict[str, Source] = {}
        self.reports: ReportBook | None = None
        self.server: AgentServer | None = None
        self.address = ""
        self.ready = False
        self._owns_api_client = False
        self._started_monotonic = 0.0
        self._runner: web.AppRunner | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._ready_task: asyncio.Task | None = None
        self._marker_started = False

    # -- building ------------------------------------------------------------------------------

    async def _build(self) -> None:
        cfg = self.config
        if self._build_cloud_sources:
            from spotguard.agent.sources.registry import build_sources
            from spotguard.agent.watch import resolve_cloud

            cloud = await resolve_cloud(cfg.cloud, cfg.metadata_url)
            self.sources += build_sources(cloud, node=cfg.node, base_url=cfg.metadata_url,
                                          interval=cfg.interval, timeout=cfg.timeout)
        if self.gpu_source is None and cfg.gpu != "off":
            self.gpu_source = _gpu_source(cfg)
        if self.gpu_source is not None:
            self.sources.append(self.gpu_source)
        if cfg.kubernetes:
            if self.api_client is None:
                from spotguard.kube import load_api_client

                self.api_client = load_api_client(cfg.kubeconfig, cfg.kube_host)
                self._owns_api_client = True
            node_source = _k8s_node_source(cfg.node, self.api_client)
            if node_source is not None:
                self.sources.append(node_source)
            if self.marker is None:
                self.marker = _node_marker(self.api_client, cfg.node, cfg.cordon)
        self.origins = {f"{i}:{s.name}": s for i, s in enumerate(self.sources)}

    async def start(self) -> str:
        """Builds, binds and starts everything; returns the bound address "host:port"."""
        await self._build()
        cfg = self.config
        if self.authenticator is None:
            if cfg.report_token_file:
                self.authenticator = SharedSecretAuth.from_file(cfg.report_token_file)
            elif cfg.kubernetes:
                self.authenticator = TokenReviewAuth(self.api_client)
            else:
                self.authenticator = RefuseAll()
        self._started_monotonic = time.monotonic()
        expected = self._expected_pods if (self.config.kubernetes and self.api_client is not None) else None
        self.reports = ReportBook(self.table, self.origins, expected_pods=expected)
        self.table.add_listener(self.metrics.observe)
        self.table.add_listener(self._notify_marker)
        self.metrics.registry.add_collector(self._collect)
        self.server = AgentServer(self.table, self.metrics, self.readiness, self.reports, self.authenticator,
                                  keepalive=cfg.keepalive, max_subscribers=cfg.max_streams,
                                  max_per_client=cfg.max_streams_per_client, body_timeout=cfg.header_timeout)
        try:
            self._runner, host, port = await start_server(self.server.make_app(), cfg.host, cfg.port,
                                                          ServerLimits(header_timeout=cfg.header_timeout))
        except OSError as exc:
            raise ConfigError("--listen", f"cannot listen on {cfg.listen}: {exc.strerror or exc}") from None
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self.marker is not None:
            await self.marker.start()
            self._marker_started = True
        for origin, source in self.origins.items():
            self._tasks[origin] = asyncio.create_task(self._run_source(origin, source), name=f"source:{origin}")
        self._ready_task = asyncio.create_task(self._await_ready(), name="readiness")
        log.info("agent listening on %s", self.address,
                 extra={"node": self.config.node, "sources": list(self.origins),
                        "mode": "cluster" if self.config.kubernetes else "local"})
        return self.address

    # -- running -------------------------------------------------------------------------------

    async def _run_source(self, origin: str, source: Source) -> None:
        backoff = Backoff(base=1.0, cap=30.0)
        while True:
            try:
                async for update in source.run():
                    self.table.apply(origin, update)
                log.info("source %s ended", origin)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                delay = backoff.next_delay()
                log.exception("source %s broke; restarting in %.1fs", origin, delay, extra={"source": source.name})
                await asyncio.sleep(delay)

    def pending_sources(self) -> list[str]:
        """The origins that have not read successfully yet (and are still running)."""
        return [o for o, s in self.origins.items()
                if s.stats.successes == 0 and not (o in self._tasks and self._tasks[o].done())]

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        pending = self.pending_sources()
        if not pending and not self.table.complete:
            self.table.mark_complete()
            log.info("every source has read: the notice table is complete")
        waited = time.monotonic() - self._started_monotonic
        if not self.ready and (not pending or waited >= self.config.ready_grace):
            self._became_ready(pending)
        return self.ready, {"node": self.config.node, "pending_sources": pending,
                            "complete": self.table.complete, "notices": len(self.table.live())}

    def _became_ready(self, pending: list[str]) -> None:
        self.ready = True
        self.metrics.ready.set(1)
        log.info("agent ready", extra={"pending_sources": pending})
        if self.marker is not None:
            self.marker.notify(self.table.live())

    async def _await_ready(self) -> None:
        """Checks readiness and completeness until both are reached."""
        while not (self.readiness()[0] and self.table.complete):
            await asyncio.sleep(0.1)

    def _notify_marker(self, published: Published) -> None:
        if self.ready and self.marker is not None:
            self.marker.notify(self.table.live())

    async def _expected_pods(self) -> set[tuple[str, str]]:
        """The opted-in pods running on this node (who must report before an early approval)."""
        kube = Kube(self.api_client, request_timeout=5)

        def list_pods() -> set[tuple[str, str]]:
            pods, _ = kube.list(PODS, None, label_selector={names.LABEL_INJECT: "true"},
                                field_selector=f"spec.nodeName={self.config.node}")
            expected: set[tuple[str, str]] = set()
            for p in pods:
                meta = p.get("metadata") or {}
                namespace, name = meta.get("namespace"), meta.get("name")
                if (isinstance(namespace, str) and isinstance(name, str)
                        and (p.get("spec") or {}).get("nodeName") == self.config.node
                        and (meta.get("labels") or {}).get(names.LABEL_INJECT) == "true"
                        and (p.get("status") or {}).get("phase") in (None, "Pending", "Running")):
                    expected.add((namespace, name))
            return expected

        return await asyncio.to_thread(list_pods)

    def _collect(self) -> None:
        m = self.metrics
        self.readiness()
        m.notices.clear()
        for notice in self.table.live():
            m.notices.inc(kind=notice.kind.value, source=notice.source)
        m.subscribers.set(self.table.subscriber_count)
        now = time.monotonic()
        for source in self.sources:
            last = source.stats.last_success_monotonic
            m.source_age.set(-1 if last is None else round(now - last, 3), source=source.name)
        polls: dict[str, int] = {}
        errors: dict[tuple[str, str], int] = {}
        for source in self.sources:  # several instances of one source add up
            polls[source.name] = polls.get(source.name, 0) + source.stats.polls
            for reason, count in source.stats.errors.items():
                errors[(source.name, reason)] = errors.get((source.name, reason), 0) + count
        for name, count in polls.items():
            m.source_polls.set_total(count, source=name)
        for (name, reason), count in errors.items():
            m.source_errors.set_total(count, source=name, reason=reason)
        stats = getattr(self.marker, "stats", None)
        if isinstance(stats, dict):
            for result, count in stats.items():
                if isinstance(count, (int, float)):
                    m.marking.set_total(count, result=str(result))
        warnings = getattr(self.gpu_source, "warnings", None)
        if isinstance(warnings, dict):
            for reason, count in warnings.items():
                m.gpu_warnings.set_total(count, reason=str(reason))
        elif isinstance(warnings, (int, float)) and not isinstance(warnings, bool):
            m.gpu_warnings.set_total(warnings, reason="all")
        if self.reports is not None:
            for result in ("approved", "approve_errors"):
                m.approvals.set_total(self.reports.counts[result], result=result)

    # -- stopping ------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Graceful shutdown; node marks are kept (the notice may still be live)."""
        tasks = [*self._tasks.values(), *([self._ready_task] if self._ready_task else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.table.close()
        if self.marker is not None and self._marker_started:
            try:
                await asyncio.wait_for(self.marker.stop(), 5.0)
            except Exception:
                log.exception("node marker did not stop cleanly")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._owns_api_client and self.api_client is not None:
            await asyncio.to_thread(self.api_client.close)
        log.info("agent stopped")


# -- optional parts (built by other modules; the agent runs without them) -------------------

def _gpu_source(cfg: AgentConfig) -> Source | None:
    """The GPU health source for `--gpu` (auto/nvml/on: NVML; fake:<file>: the scripted fake)."""
    try:
        from spotguard.agent.gpu.select import make_backend
        from spotguard.agent.sources.gpu import GpuHealthSource
    except ImportError as exc:
        if cfg.gpu != "auto":
            raise ConfigError("--gpu", f"the GPU health source is not available ({exc})") from None
        log.info("GPU health source not available (%s); running without it", exc)
        return None
    backend = make_backend("nvml" if cfg.gpu == "on" else cfg.gpu, "--gpu")
    if backend is None:
        log.info("no NVML binding installed; running without the GPU health source")
        return None
    policy = None
    if cfg.gpu_policy:
        from spotguard.agent.gpu.policy import GpuPolicy

        policy = GpuPolicy.load(cfg.gpu_policy, "--gpu-policy")
    return GpuHealthSource(cfg.node, backend=backend, policy=policy)


def _k8s_node_source(node: str, api_client: Any) -> Source | None:
    try:
        from spotguard.agent.sources.k8s_node import k8s_node_source
    except ImportError as exc:
        log.warning("Kubernetes node source not available (%s)", exc)
        return None
    return k8s_node_source(node, api_client)


def _node_marker(api_client: Any, node: str, cordon: bool) -> Any:
    try:
        from spotguard.agent.node_marker import NodeMarker
    except ImportError as exc:
        log.warning("node marker not available (%s): the node will not be marked", exc)
        return None
    return NodeMarker(api_client, node, cordon=cordon)


async def run_agent(agent: Agent, stop: asyncio.Event,
                    announce: Callable[[str], Awaitable[None] | None] | None = None) -> None:
    """Starts `agent`, calls `announce(address)`, waits for `stop`, then stops it."""
    await agent.start()
    try:
        if announce is not None:
            result = announce(agent.address)
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
    finally:
        await agent.stop()
