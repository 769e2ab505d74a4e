"""Forwards the pod's hook outcomes and timing to the node agent (POST /v1/reports).

`ReportPlanner` turns the pod's `Progress` for a notice into agent reports (protocol body):
- `checkpointed` as soon as every expected rank is done (hook_seconds.checkpoint = slowest
  rank), so the agent can approve early (Azure) without waiting for the drain;
- `checkpointed` again once every rank also drained, now with hook_seconds.drain;
- `failed` on the first rank whose checkpoint failed (nothing is approved early).
Each carries the pod's `durable_tier` when a rank reported one (`Progress.durable_tier`): the
drained report has the tier the ranks settled on after waiting for their upload.
Each (notice, status) is sent at most once; the agent must accept a later report for the same
notice and pod as an update.

`Reporter` sends them from its own task: `submit()` only enqueues (bounded; the oldest report
is dropped when full), so a slow or absent agent never blocks the relay or a hook POST. Each
attempt re-reads the bearer token file (projected service-account tokens rotate). Network
errors, 401, 429 and 5xx are retried with backoff for up to `give_up_after` seconds; other
statuses drop the report with an error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from spotguard.backoff import Backoff
from spotguard.hooks.sidecar.prestop import Progress
from spotguard.wire.agent_report import Report

log = logging.getLogger(__name__)

RETRY_STATUSES = {401, 408, 429}


class ReportPlanner:
    """Decides which agent reports a pod's progress calls for (at most one per notice and stage)."""

    def __init__(self, pod: str, namespace: str, max_notices: int = 256):
        self.pod, self.namespace = pod, namespace
        self.max_notices = max_notices
        self._sent: dict[str, set[str]] = {}

    def plan(self, progress: Progress) -> dict[str, Any] | None:
        sent = self._sent.setdefault(progress.notice_id, set())
        if len(self._sent) > self.max_notices:
            del self._sent[next(iter(self._sent))]
        if "failed" in sent:
            return None
        if progress.failed_ranks:
            stage, status = "failed", "failed"
        elif progress.all_drained and "drained" not in sent:
            stage, status = "drained", "checkpointed"
        elif progress.complete and "checkpointed" not in sent:
            stage, status = "checkpointed", "checkpointed"
        else:
            return None
        sent.update({stage, "checkpointed"} if stage == "drained" else {stage})
        states = list(progress.ranks.values())
        hook_seconds = {"checkpoint": max((s.checkpoint_seconds for s in states), default=0.0)}
        if stage == "drained":
            hook_seconds["drain"] = max(s.drain_seconds for s in states)
        return Report(progress.notice_id, self.pod, self.namespace, status,
                      step=max((s.step for s in states), default=0), hook_seconds=hook_seconds,
                      steps_lost=max((s.steps_lost for s in states), default=0),
                      durable_tier=progress.durable_tier).to_wire()


def read_token(path: str) -> str:
    """The bearer token in `path`, stripped (blocking)."""
    with open(path, encoding="utf-8") as f:
        return f.read(16384).strip()


class Reporter:
    """Delivers report bodies to `<agent_url>/v1/reports` from a background task."""

    def __init__(self, agent_url: str, token_file: str | None, max_queue: int = 256,
                 give_up_after: float = 120.0, timeout: float = 5.0, backoff: Backoff | None = None):
        self.url = agent_url.rstrip("/") + "/v1/reports"
        self.token_file = token_file
        self.give_up_after = give_up_after
        self.timeout = timeout
        self.backoff = backoff or Backoff(base=0.2, cap=5.0)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=max_queue)
        self.sent = 0
        self.dropped = 0

    def submit(self, body: dict[str, Any]) -> None:
        """Enqueues a report; never blocks."""
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
            log.error("report queue full: dropped the oldest report")
        self._queue.put_nowait(body)

    async def run(self) -> None:
        """Sends queued reports until cancelled."""
        if self.token_file is None:
            log.warning("no agent token file: hook reports are not forwarded to the agent")
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(trust_env=False, timeout=timeout) as session:
            while True:
                body = await self._queue.get()
                if self.token_file is None:
                    continue
                try:
                    await self._deliver(session, body)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad report must not stop the next
                    log.exception("report for %s not delivered", body.get("notice_id"))

    async def _deliver(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> bool:
        give_up = time.monotonic() + self.give_up_after
        self.backoff.reset()
        while True:
            problem = await self._attempt(session, body)
            if problem is None:
                self.sent += 1
                return True
            if problem.startswith("final:") or time.monotonic() >= give_up:
                self.dropped += 1
                log.error("report for %s dropped: %s", body["notice_id"], problem.removeprefix("final:"))
                return False
            log.warning("report for %s: %s; retrying", body["notice_id"], problem)
            await asyncio.sleep(self.backoff.next_delay())

    async def _attempt(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> str | None:
        """None on success, else what went wrong (prefixed "final:" when retrying is useless)."""
        if self.token_file is None:
            return "final: no agent token file"
        try:
            token = await asyncio.to_thread(read_token, self.token_file)
        except (OSError, UnicodeDecodeError) as exc:
            return f"cannot read token file {self.token_file}: {exc}"
        try:
            async with session.post(self.url, json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
                if 200 <= resp.status < 300:
                    return None
                text = (await resp.content.read(512)).decode("utf-8", "replace")
                if resp.status in RETRY_STATUSES or resp.status >= 500:
                    return f"HTTP {resp.status} {text}"
                return f"final:HTTP {resp.status} {text}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
