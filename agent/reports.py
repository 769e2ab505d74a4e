"""Sidecar reports (`POST /v1/reports`) and the early approval they allow.

Contract:
- The body is `wire.agent_report.Report` (`parse_report` validates it).
- `ReportBook.record(report)` keeps the latest report per (namespace, pod) for each live
  notice (bounded; dropped when the notice is withdrawn) and then decides on early approval.
- A notice is approved early only if the source that reported it can approve (has
  `approve(event_id)`, e.g. Azure Scheduled Events), at least one authenticated report says
  `checkpointed`, none says `failed`, and every pod that `expected_pods` lists (cluster mode:
  the opted-in pods on the node) has reported `checkpointed`. With no reports, nothing is
  approved early. A failed approval is logged and retried on the next report.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable, Mapping

from spotguard.agent.table import NoticeTable, Published
from spotguard.wire.agent_report import Report
from spotguard.wire.notice import Notice
from spotguard.wire.withdrawal import Withdrawal

log = logging.getLogger(__name__)

PodKey = tuple[str, str]  # (namespace, pod)
ExpectedPods = Callable[[], Awaitable["set[PodKey] | None"]]


@dataclass
class Outcome:
    """What recording a report did: `approved` is True once the notice has been approved."""

    recorded: bool
    approved: bool = False
    approval_pending: str | None = None  # why it is not approved (yet), when it could be

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"recorded": self.recorded, "approved": self.approved}
        if self.approval_pending:
            out["approval_pending"] = self.approval_pending
        return out


class ReportBook:
    """See the module docstring. `approvers` maps a table origin to its source object."""

    def __init__(self, table: NoticeTable, approvers: Mapping[str, Any],
                 expected_pods: ExpectedPods | None = None, max_pods_per_notice: int = 256,
                 approve_timeout: float = 10.0):
        self.table = table
        self.approvers = approvers
        self.expected_pods = expected_pods
        self.max_pods = max_pods_per_notice
        self.approve_timeout = approve_timeout
        self._reports: dict[str, dict[PodKey, Report]] = {}
        self._approved: set[str] = set()
        self._lock = asyncio.Lock()
        self.counts = {"recorded": 0, "approved": 0, "approve_errors": 0}
        table.add_listener(self._on_change)

    def reports_for(self, notice_id: str) -> list[Report]:
        return list(self._reports.get(notice_id, {}).values())

    def approved(self, notice_id: str) -> bool:
        return notice_id in self._approved

    def _on_change(self, published: Published) -> None:
        if isinstance(published.change, Withdrawal):
            self._reports.pop(published.change.notice_id, None)
            self._approved.discard(published.change.notice_id)

    async def record(self, report: Report) -> Outcome:
        """Stores the report (KeyError if its notice is not live) and tries early approval."""
        notice = self.table.get(report.notice_id)
        if notice is None:
            raise KeyError(report.notice_id)
        pods = self._reports.setdefault(report.notice_id, {})
        key = (report.namespace, report.pod)
        if key not in pods and len(pods) >= self.max_pods:
            raise OverflowError(f"more than {self.max_pods} pods reported for this notice")
        pods[key] = report
        self.counts["recorded"] += 1
        async with self._lock:  # one approval attempt at a time: never approve twice
            return await self._maybe_approve(notice)

    async def _maybe_approve(self, notice: Notice) -> Outcome:
        if notice.id in self._approved:
            return Outcome(True, approved=True)
        approver = next((self.approvers[o] for o in self.table.origins_of(notice.id)
                         if hasattr(self.approvers.get(o), "approve")), None)
        if approver is None:
            return Outcome(True)
        reports = self._reports.get(notice.id, {})
        if any(r.status == "failed" for r in reports.values()):
            return Outcome(True, approval_pending="a pod reported a failed checkpoint")
        done = {k for k, r in reports.items() if r.status == "checkpointed"}
        if not done:
            return Outcome(True, approval_pending="no checkpointed report yet")
        if self.expected_pods is not None:
            try:
                expected = await self.expected_pods()
            except Exception as exc:  # cannot tell who else must report: wait
                log.warning("cannot list the node's opted-in pods: %s", exc)
                return Outcome(True, approval_pending="cannot list the node's opted-in pods")
            missing = (expected or set()) - done
            if missing:
                return Outcome(True, approval_pending=f"waiting for {len(missing)} pod(s) to checkpoint")
        event_id = notice.detail.get("EventId") or notice.detail.get("event_id")
        if not isinstance(event_id, str) or not event_id:
            return Outcome(True, approval_pending="the notice carries no event id to approve")
        try:
            result = approver.approve(event_id)
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, self.approve_timeout)
        except Exception as exc:
            self.counts["approve_errors"] += 1
            log.warning("approving %s failed: %s", event_id, exc, extra={"notice_id": notice.id})
            return Outcome(True, approval_pending=f"approval failed ({exc.__class__.__name__}); will retry")
        self._approved.add(notice.id)
        self.counts["approved"] += 1
        log.info("approved %s early after checkpointed reports", event_id,
                 extra={"notice_id": notice.id, "pods": len(done), "at": time.time()})
        return Outcome(True, approved=True)
