"""Hook reports from the pod's ranks, and the preStop wait built on them.

The report body (POST /v1/hooks) is `wire.hook_report.HookReport`. `HookBook` keeps, per notice id and
rank, what the rank reported, and says how far the pod is (`Progress`), with each departing rank's
account of its checkpoint (`Progress.departures`: `saved_by`, `margin_seconds`, `snapshot_steps`, as
the rank last reported them; the POST /v1/hooks answer and the preStop result carry them).

Expected ranks of the pod: `local_world_size` when configured (`--local-world-size` /
SPOTGUARD_LOCAL_WORLD_SIZE, what a multi-pod job must set: the ranks *in this pod*); otherwise
the `world_size` of the first report for that notice, which is right for a job whose ranks all
run in this pod (a single-pod torchrun or deepspeed launch).

A rank is *done* for a notice when its last checkpoint outcome was `checkpoint-durable`, or it
reported `drained` without a failed checkpoint; it has *failed* when its last checkpoint outcome
was `failed`. `wait_for_pod` (GET /v1/prestop) returns when some live notice has every expected
rank done, when every expected rank has reported an outcome and one failed, when no notice is
live, or when the timeout or the earliest live deadline passes. "No notice is live" is believed
only once the sidecar's view is complete (a complete snapshot from its agent): a sidecar that
has just restarted, or whose agent has not read its sources yet, waits up to
`UNSETTLED_WAIT_SECONDS` for it before it answers `no-notice`, so a restart never releases a
pod whose notice it has not heard of again yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from spotguard.hooks.sidecar.broadcast import Pulse
from spotguard.wire.hook_report import DURABLE_TIERS, HookReport
from spotguard.wire.live import LiveSet

UNSETTLED_WAIT_SECONDS = 30.0


@dataclass
class RankState:
    checkpoint: str | None = None  # "checkpoint-durable" | "failed" | None
    drained: bool = False
    step: int = 0
    checkpoint_seconds: float = 0.0
    drain_seconds: float = 0.0
    steps_lost: int = 0
    durable_tier: str | None = None  # the rank's latest report of it (None: never told)
    saved_by: str | None = None  # how its checkpoint was made (wire.hook_report.SAVED_BY; None: never told)
    margin_seconds: float | None = None  # seconds to the deadline when it left
    snapshot_steps: int | None = None  # steps trained after the saved step

    @property
    def done(self) -> bool:
        return self.checkpoint == "checkpoint-durable" or (self.drained and self.checkpoint is None)

    @property
    def failed(self) -> bool:
        return self.checkpoint == "failed"


@dataclass
class Progress:
    """How far the pod's ranks are with one notice."""

    notice_id: str
    expected: int | None
    ranks: dict[int, RankState] = field(default_factory=dict)

    @property
    def done_ranks(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.done)

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.failed)

    @property
    def complete(self) -> bool:
        """Every expected rank is done."""
        return self.expected is not None and len(self.done_ranks) >= self.expected

    @property
    def all_drained(self) -> bool:
        return self.complete and sum(1 for s in self.ranks.values() if s.drained) >= (self.expected or 0)

    @property
    def failed(self) -> bool:
        """Every expected rank has an outcome and at least one failed: waiting longer is useless."""
        finished = len(self.done_ranks) + len(self.failed_ranks)
        return bool(self.failed_ranks) and self.expected is not None and finished >= self.expected

    @property
    def durable_tier(self) -> str | None:
        """The pod's weakest tier: "local" when any rank's checkpoint is on this node only (it goes
        with the node), else the tier the ranks reported; None when no rank reported one."""
        tiers = {s.durable_tier for s in self.ranks.values() if s.durable_tier is not None}
        return next((tier for tier in DURABLE_TIERS if tier in tiers), None)

    @property
    def departures(self) -> list[dict[str, Any]]:
        """Each rank that said how its checkpoint was made: its rank, step, `saved_by`,
        `margin_seconds` and `snapshot_steps` as it reported them (rank order)."""
        return [{"rank": rank, "step": s.step, "saved_by": s.saved_by,
                 **{k: v for k, v in (("margin_seconds", s.margin_seconds), ("snapshot_steps", s.snapshot_steps))
                    if v is not None}}
                for rank, s in sorted(self.ranks.items()) if s.saved_by is not None]

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"notice_id": self.notice_id, "expected_ranks": self.expected,
                                "done_ranks": self.done_ranks, "failed_ranks": self.failed_ranks}
        if self.durable_tier is not None:
            body["durable_tier"] = self.durable_tier
        departures = self.departures
        if departures:
            body["departures"] = departures
        return body


class HookBook:
    """Hook reports per notice and rank; `pulse` fires on every recorded report."""

    def __init__(self, local_world_size: int | None = None, pulse: Pulse | None = None,
                 max_notices: int = 64):
        self.local_world_size = local_world_size
        self.pulse = pulse or Pulse()
        self.max_notices = max_notices
        self._progress: dict[str, Progress] = {}

    def record(self, report: HookReport) -> Progress:
        progress = self._progress.get(report.notice_id)
        if progress is None:
            if len(self._progress) >= self.max_notices:  # oldest first: dicts keep insertion order
                del self._progress[next(iter(self._progress))]
            progress = Progress(report.notice_id, self.local_world_size or report.world_size)
            self._progress[report.notice_id] = progress
        state = progress.ranks.setdefault(report.rank, RankState())
        state.step = max(state.step, report.step)
        state.steps_lost = report.steps_lost
        if report.durable_tier is not None:
            state.durable_tier = report.durable_tier
        if report.saved_by is not None:  # an extra-less resend keeps what the rank said
            state.saved_by, state.margin_seconds, state.snapshot_steps = (report.saved_by, report.margin_seconds,
                                                                          report.snapshot_steps)
        if report.phase == "drained":
            state.drained = True
            state.drain_seconds = report.seconds
        else:
            state.checkpoint = report.phase
            state.checkpoint_seconds = report.seconds
        self.pulse.notify()
        return progress

    def progress(self, notice_id: str) -> Progress:
        return self._progress.get(notice_id) or Progress(notice_id, self.local_world_size)


@dataclass(frozen=True)
class PrestopResult:
    outcome: str  # done | failed | no-notice | withdrawn | timeout | deadline
    waited: float
    notice_id: str | None
    progress: Progress | None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"v": 1, "outcome": self.outcome, "waited_seconds": round(self.waited, 3),
                                "notice_id": self.notice_id}
        if self.progress is not None:
            body.update(self.progress.to_wire())
        return body


async def wait_for_pod(live: LiveSet, book: HookBook, pulse: Pulse, timeout: float,
                       unsettled_wait: float = UNSETTLED_WAIT_SECONDS) -> PrestopResult:
    """Blocks until the pod's ranks are done with a live notice, or it is pointless to wait.

    `pulse` must fire on every change of `live` (its completeness included) and of `book`.
    Advisory notices are information, never waited for: with only advisories live, it is as
    with none.
    """
    start = time.monotonic()
    had_notice = False
    while True:
        notices = [n for n in live.notices() if not n.advisory]
        waited = time.monotonic() - start
        if not notices:
            settle_left = min(timeout, unsettled_wait) - waited
            if live.complete or settle_left <= 0:
                return PrestopResult("withdrawn" if had_notice else "no-notice", waited, None, None)
            await pulse.wait(settle_left)
            continue
        had_notice = True
        watched = [(n, book.progress(n.id)) for n in notices]
        for notice, progress in watched:
            if progress.complete:
                return PrestopResult("done", waited, notice.id, progress)
        for notice, progress in watched:
            if progress.failed:
                return PrestopResult("failed", waited, notice.id, progress)
        urgent, urgent_progress = watched[0]
        deadline_left = urgent.seconds_left()
        timeout_left = timeout - waited
        if deadline_left is not None and deadline_left <= 0:
            return PrestopResult("deadline", waited, urgent.id, urgent_progress)
        if timeout_left <= 0:
            return PrestopResult("timeout", waited, urgent.id, urgent_progress)
        await pulse.wait(timeout_left if deadline_left is None else min(timeout_left, deadline_left))
