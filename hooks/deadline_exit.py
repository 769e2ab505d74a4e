"""What the deadline watchdog does once it owns the answer to a notice: persist the held snapshot
(or find it durable already), then leave with 83, or with 84 when nothing new could be made
durable (the previous checkpoint stays the newest). Runs on the watchdog's thread; the main
thread may be blocked anywhere meanwhile.

Contract of `DeadlineExit.persist(...)`:
1. every rank must hold the claimed snapshot step (`Claims.held_by_all`, through the store): the
   persist is collective on the adapter's checkpoint group, which only the ranks' writer threads
   use, never training or the Guard's agreement;
2. an async save in flight (`save_async`) is waited for until the latest exit time: committed,
   it is the newest durable checkpoint (and, being the held snapshot's copy, nothing is persisted
   again); still running then, it is abandoned (the process leaves: its commit never happens, the
   store's commit being all or nothing); its fate is reported as `async_save`;
3. otherwise the held snapshot is persisted through the adapter's commit protocol, waited for
   until the latest exit time.
Before each wait the last-resort timer may end (2, 3), the message true in that case is
written (`why` "async-abandoned" / "persist-late", exit 84).
`leave(...)` writes the termination message (with `saved_by` "watchdog", `margin_seconds` to the
deadline, `snapshot_steps`: the steps trained after the saved snapshot), reports to the sidecar
when one is configured and time allows, waits (`LEAVE_TOGETHER_SECONDS` at most, never past the
deadline) until every rank is leaving (`Claims.leaving`), and ends the process (`flush_and_exit`) under the
last-resort timer, re-armed with the same code. `leave_nothing_new(...)` is the departure with
nothing to save: 83, no step lost. `hold_process()` (called once the watchdog owns the answer)
keeps the interpreter from ending on its own meanwhile: a peer that leaves first fails the main
thread's collective, and that exception must not end the process before the watchdog's exit
(an atexit hook waits for it; the last-resort timer bounds the wait).
"""
from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from spotguard.hooks.deadline_claims import Claims
from spotguard.hooks.deadline_policy import FINISH_SECONDS
from spotguard.hooks.exit_timer import ExitTimer
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.termination_message import departure_account, write_termination_message
from spotguard.processes import flush_and_exit
from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.deadline")

REPORT_SECONDS = 1.0  # the longest a report to the sidecar may take before the rank leaves
LEAVE_TOGETHER_SECONDS = 3.0  # the longest a leaving rank waits for its peers to be leaving too
HOLD_SECONDS = 600.0  # an interpreter ending while the watchdog leaves waits this long at most


@dataclass
class Progress:
    """What this rank trained: the newest completed step, how many steps it completed in this
    process, and the newest durable checkpoint's step."""

    completed: int | None = None
    durable: int | None = None
    trained: int = 0

    def complete(self, step: int) -> None:
        """Step `step` completed (the Guard's boundary)."""
        self.completed = step
        self.trained += 1

    def saw_persisted(self, adapter: Any) -> None:
        """The step `adapter`'s snapshot engine persisted last is durable (none: nothing learned)."""
        self.saw_durable(getattr(getattr(adapter, "snapshot_engine", None), "persisted_step", None))

    def saw_durable(self, step: int | None) -> None:
        """A checkpoint of `step` is durable (the newest wins)."""
        if step is not None and (self.durable is None or step > self.durable):
            self.durable = step

    def lost_since(self, saved: int | None) -> int:
        """Steps trained after `saved` (the newest step that survives); with none known, the steps
        this process completed (step numbers may start at 0 or 1: the Trainer's and Lightning's
        global step counts from 1)."""
        if self.completed is None:
            return 0
        return self.completed - saved if saved is not None else self.trained


class DeadlineExit:
    """See the module docstring."""

    def __init__(self, adapter: Callable[[], Any], claims: Callable[[], Claims], timer: ExitTimer,
                 reporter: HookReporter | None = None):
        self.adapter, self.claims, self.timer, self.reporter = adapter, claims, timer, reporter

    def hold_process(self) -> None:
        """See the module docstring."""
        atexit.register(time.sleep, HOLD_SECONDS)

    def persist(self, step: int, notice: Notice, deadline: float, leave_at: float, progress: Progress) -> None:
        """See the module docstring (`leave_at`: the last-resort exit's time); never returns."""
        started, end = time.time(), leave_at - FINISH_SECONDS
        adapter = self.adapter()
        held = getattr(adapter, "snapshot_step", None)
        claims = self.claims()
        claims.report_held(held)
        if adapter is None or not claims.held_by_all(step, max(end - time.time(), 0.0)):
            log.error("deadline watchdog: not every rank holds the snapshot of step %d (here: %s): nothing "
                      "persisted", step, held)
            self.leave(notice, deadline, progress, None, started, why="no-common-snapshot")
        engine = adapter.snapshot_engine
        async_save = None
        in_flight = engine.in_flight()
        if in_flight is not None:
            self._account_ahead(notice, deadline, leave_at, progress, why="async-abandoned", async_save="abandoned")
            try:
                in_flight.result(timeout=max(end - time.time(), 0.0))
                async_save = "committed"
            except FutureTimeout:
                log.error("deadline watchdog: the async save of step %d is still running at the latest exit: "
                          "abandoned (the previous checkpoint stays the newest)", held)
                self.leave(notice, deadline, progress, None, started, why="async-abandoned",
                           async_save="abandoned")
            except BaseException:  # DCP's CheckpointException derives from BaseException
                async_save = "failed"
        if adapter.snapshot_durable():
            self.leave(notice, deadline, progress, step, started, async_save=async_save)
        self._account_ahead(notice, deadline, leave_at, progress, why="persist-late", async_save=async_save)
        try:
            _, write = adapter.persist_snapshot_behind(reason="notice", notice=notice)
            write.result(timeout=max(end - time.time(), 0.0))
        except FutureTimeout:
            log.error("deadline watchdog: the snapshot of step %d was not durable by the latest exit", step)
            self.leave(notice, deadline, progress, None, started, why="persist-late", async_save=async_save)
        except BaseException:
            log.exception("deadline watchdog: persisting the snapshot of step %d failed", step)
            self.leave(notice, deadline, progress, None, started, why="persist-failed", async_save=async_save)
        self.leave(notice, deadline, progress, step, started, async_save=async_save)

    def leave_nothing_new(self, notice: Notice, deadline: float, progress: Progress) -> None:
        """Leaves with 83 at once: nothing was trained since the newest durable checkpoint."""
        log.warning("notice %s: nothing trained since the newest checkpoint (step %s): leaving now", notice.id,
                    progress.durable)
        self.leave(notice, deadline, progress, progress.durable, time.time(), saved_by="nothing-new")

    def leave(self, notice: Notice, deadline: float, progress: Progress, saved: int | None, started: float, *,
              why: str | None = None, async_save: str | None = None, saved_by: str = "watchdog") -> None:
        """Termination message, report, exit: 83 when `saved` (a step now durable) is not None or
        nothing was trained since the durable checkpoint, else 84. Never returns."""
        progress.saw_persisted(self.adapter())
        durable = saved is not None or saved_by == "nothing-new"
        code = EXIT_PREEMPTED if durable else EXIT_CHECKPOINT_FAILED
        self.timer.arm(time.monotonic() + max(min(REPORT_SECONDS + LEAVE_TOGETHER_SECONDS + 0.5,
                                                  deadline - time.time() - 0.1), 0.5), code)
        newest = saved if saved is not None else progress.durable
        lost, extra = self._write_account(notice, progress, saved, deadline - time.time(), durable, code,
                                          why=why, async_save=async_save, saved_by=saved_by)
        self._report(notice, newest, durable, time.time() - started, lost, extra)
        self._wait_for_peers(deadline)
        log.warning("deadline watchdog: leaving for notice %s (%s: step %s %s, %d steps lost, %.2fs before the "
                    "deadline): exit %d", notice.id, saved_by, newest, "durable" if durable else "FAILED", lost,
                    deadline - time.time(), code)
        flush_and_exit(code)

    def _account_ahead(self, notice: Notice, deadline: float, leave_at: float, progress: Progress, *, why: str,
                       async_save: str | None) -> None:
        """Writes, before a wait the last-resort timer may end, the message that is true if it
        does: nothing new durable, for reason `why`, `deadline - leave_at` before the deadline
        (the process cannot write anything once the timer fired; a wait that ends in time is
        followed by `leave`, which writes the final account over this one)."""
        self._write_account(notice, progress, None, deadline - leave_at, False, EXIT_CHECKPOINT_FAILED, why=why,
                            async_save=async_save, saved_by="watchdog")

    @staticmethod
    def _write_account(notice: Notice, progress: Progress, saved: int | None, seconds_left: float, durable: bool,
                       code: int, *, why: str | None, async_save: str | None,
                       saved_by: str) -> tuple[int, dict[str, Any]]:
        """The termination message of a departure: steps lost and the account's extra fields."""
        newest = saved if saved is not None else progress.durable
        step = progress.completed if progress.completed is not None else (newest if newest is not None else -1)
        extra = departure_account(saved_by, progress.completed if saved is not None else None, saved, seconds_left)
        extra.update({k: v for k, v in (("why", why), ("async_save", async_save)) if v is not None})
        lost = progress.lost_since(newest)
        write_termination_message(notice.id, step, saved if saved is not None else step, durable,
                                  steps_lost=lost, extra=extra, exit_code=code)
        return lost, extra

    def _wait_for_peers(self, deadline: float) -> None:
        try:
            if not self.claims().leaving(min(LEAVE_TOGETHER_SECONDS, deadline - time.time() - 0.2)):
                log.warning("deadline watchdog: not every rank was leaving yet; leaving anyway")
        except Exception as exc:  # the store's host (rank 0) may be gone already
            log.warning("deadline watchdog: could not tell the other ranks (%s); leaving anyway", exc)

    def _report(self, notice: Notice, saved: int | None, durable: bool, seconds: float, lost: int,
                extra: dict[str, Any]) -> None:
        reporter = self.reporter
        if reporter is None or saved is None:
            return
        reporter.timeout = min(reporter.timeout, REPORT_SECONDS / 2)
        reporter.report(notice.id, saved, "checkpoint-durable" if durable else "failed", seconds, steps_lost=lost,
                        saved_step=saved, **extra)
        if durable:
            reporter.report(notice.id, saved, "drained", 0.0, steps_lost=lost, saved_step=saved, **extra)
