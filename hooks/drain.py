"""The drain at the agreed step, and what a rank does after it: the only place a rank exits.

`DrainSequence(...).run(step, verdict)` on every rank, in this order:
1. the agreed notice: `verdict.source_rank` broadcasts its notice, every rank takes the agreed
   (earliest) deadline;
2. the save decision (`save_decision`, one collective vote; none for an adapter whose
   `takes_snapshots` is False): fresh `adapter.save(step)` or `adapter.persist_snapshot()`; then
   the `@on_reclaim` hooks `hook(step, notice)`;
3. `all_ok`: the checkpoint counts only when every rank succeeded; report `checkpoint-durable`
   (or `failed`) with the seconds taken;
4. when it succeeded: the `@on_drain` hooks (a failure is logged, the rank leaves anyway) and
   report `drained`; the termination message (steps lost) for the supervisor
   (`termination_message`). Returns the `DrainRecord`.
A SystemExit or KeyboardInterrupt inside a save or hook propagates; anything else counts as a
failed checkpoint.

`start(...)` is steps 1-2 with the durable write left running behind (`PendingCheckpoint`), and
`PendingCheckpoint.finish()` the rest: the write's outcome, the @on_reclaim hooks (after the
checkpoint is durable, as in `run`), 3 and 4; `without_vote()` waits for the write alone (a
failed in-place change, whose groups may be broken). `run` is `start(...).finish()`.

Then the Guard hands the record to its `Departure`, the seam between a drain and what follows:
- `ExitProcess`: closes the Guard, leaves the process groups together (`leave`), raises
  SystemExit(`EXIT_PREEMPTED` 83, or `EXIT_CHECKPOINT_FAILED` 84 when any rank failed). With
  `hard_exit` an atexit hook (registered when the ExitProcess is made, so exit handlers
  registered later run first) flushes logging/stdio and calls `os._exit(code)`: torch's C++
  teardown intermittently aborts in gloo and would turn an 83 into a crash.
- `ReturnToLoop`: `step()` returns True and training code decides (`exit_on_drain=False`).
Survivors of an in-place change never reach a departure: `DrainSequence.run(..., staying=True)`
only checkpoints, and the Guard hands them to `hooks.elastic.reformer`.
"""
from __future__ import annotations

import atexit
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from spotguard.hooks import save_decision
from spotguard.hooks.agreement.base import Verdict
from spotguard.hooks.adapters.base import StoreAdapter, done_future, tag_for
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.hook_reporter import HookReporter
from spotguard.hooks.termination_message import write_termination_message
from spotguard.processes import flush_and_exit
from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from spotguard.wire.notice import Notice

if TYPE_CHECKING:
    from spotguard.hooks.adapters.base import CheckpointAdapter

log = logging.getLogger("spotguard.hooks.guard")

Hook = Callable[[int, Notice], object]


@dataclass
class DrainRecord:
    """What happened at the agreed step."""

    step: int  # the step at which every rank agreed
    saved_step: int  # the step the durable checkpoint holds (older when a snapshot was persisted)
    notice: Notice
    used_snapshot: bool
    ok: bool
    exit_code: int
    checkpoint_seconds: float
    drain_seconds: float
    hooks_started_at: float  # time.time() when this rank started the reclaim hooks

    @property
    def steps_lost(self) -> int:
        return self.step - self.saved_step


@dataclass
class PendingCheckpoint:
    """A checkpoint of `step` whose durable write runs behind (`DrainSequence.start`, or a grow's
    `elastic.in_place.start_save_before_grow`). `write` is done when the store's commit protocol
    ended on every rank: its result means durable and committed by every rank, its exception
    failed on every rank (a checkpoint is complete or invisible)."""

    step: int
    saved_step: int
    notice: Notice
    used_snapshot: bool
    started: float  # time.time() when the save started
    t0: float  # time.monotonic() then
    write: Future
    finisher: Callable[[PendingCheckpoint], DrainRecord]
    record: DrainRecord | None = None

    def written(self) -> bool:
        """Waits for the write; whether it is durable. No collective of the caller's own."""
        try:
            self.write.result()
            return True
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                raise
            log.exception("checkpoint of step %d for notice %s failed", self.saved_step, self.notice.id)
            return False

    def finish(self) -> DrainRecord:
        """The rest of the checkpoint (collective, like the start): once; later calls return the record."""
        if self.record is None:
            self.record = self.finisher(self)
        return self.record

    def without_vote(self) -> DrainRecord:
        """A failed change's end (its groups may be broken): waits for the write alone (never a
        collective, never a hook) and records it, 83 when durable, 84 when not."""
        if self.record is not None:
            return self.record
        ok = self.written()
        self.record = DrainRecord(self.step, self.saved_step, self.notice, self.used_snapshot, ok,
                                  EXIT_PREEMPTED if ok else EXIT_CHECKPOINT_FAILED, time.monotonic() - self.t0,
                                  0.0, self.started)
        return self.record


def agreed_notice(collectives: Collectives, verdict: Verdict) -> Notice:
    """The notice every rank acts on: the one `verdict.source_rank` contributed, with the agreed deadline."""
    notice = verdict.pending
    if collectives.distributed:
        payload = b""
        if collectives.rank == verdict.source_rank and verdict.pending is not None:
            payload = verdict.pending.to_json().encode()
        notice = Notice.from_json(collectives.broadcast_bytes(payload, verdict.source_rank))
    if notice is None:
        raise ValueError("a verdict without a pending notice (a single process acts only on its own notice)")
    if math.isfinite(verdict.deadline_ts):
        notice = notice.with_deadline(datetime.fromtimestamp(verdict.deadline_ts, UTC))
    return notice


class DrainSequence:
    """See the module docstring."""

    def __init__(self, collectives: Collectives, adapter: CheckpointAdapter | None, *,
                 reclaim_hooks: Sequence[Hook] = (), drain_hooks: Sequence[Hook] = (),
                 reporter: HookReporter | None = None, save_margin_seconds: float = 1.0):
        self.collectives = collectives
        self.adapter = adapter
        self.reclaim_hooks = reclaim_hooks
        self.drain_hooks = drain_hooks
        self.reporter = reporter
        self.save_margin_seconds = save_margin_seconds

    def run(self, step: int, verdict: Verdict | None, *, notice: Notice | None = None,
            staying: bool = False) -> DrainRecord:
        """`notice`: the agreed notice when the caller already has it. `staying`: this rank
        continues in place after the checkpoint (no @on_drain hooks, no `drained` report, no
        termination message: it did not drain)."""
        return self.start(step, verdict, notice=notice, staying=staying).finish()

    def start(self, step: int, verdict: Verdict | None, *, notice: Notice | None = None,
              staying: bool = False) -> PendingCheckpoint:
        """The save decision and the copy of the state (collective); the durable write goes on
        behind (an adapter without the snapshot engine writes here). `finish()` is the rest of
        `run`: the write's outcome, the @on_reclaim hooks, the vote, reports, drain hooks."""
        if notice is None:
            if verdict is None:
                raise ValueError("DrainSequence.run needs the verdict or the agreed notice")
            notice = agreed_notice(self.collectives, verdict)
        started, t0 = time.time(), time.monotonic()
        saved_step, used_snapshot = step, False
        try:
            saved_step, used_snapshot, write = self._start_checkpoint(step, notice)
        except BaseException as exc:  # a failed save must still drain with its own exit code
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                raise
            write = Future()
            write.set_exception(exc)
        return PendingCheckpoint(step, saved_step, notice, used_snapshot, started, t0, write,
                                 lambda pending: self._finish(pending, staying))

    def _finish(self, pending: PendingCheckpoint, staying: bool) -> DrainRecord:
        step, notice, saved_step = pending.step, pending.notice, pending.saved_step
        used_snapshot = pending.used_snapshot
        ok = pending.written()
        if ok:
            try:
                for hook in self.reclaim_hooks:
                    hook(step, notice)
            except BaseException as exc:
                if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                    raise
                log.exception("@on_reclaim hook for notice %s at step %d failed on rank %d", notice.id, step,
                              self.collectives.rank)
                ok = False
        ok = self.collectives.all_ok(ok)
        checkpoint_seconds = time.monotonic() - pending.t0
        started = pending.started
        extra: dict = {"steps_lost": step - saved_step, "saved_step": saved_step}
        tier = self._tier(saved_step) if ok else None
        if tier is not None:
            extra["durable_tier"] = tier
        self._report(notice, saved_step, "checkpoint-durable" if ok else "failed", checkpoint_seconds, extra)
        drain_seconds = 0.0
        if staying and ok:
            return DrainRecord(step, saved_step, notice, used_snapshot, ok, EXIT_PREEMPTED, checkpoint_seconds, 0.0,
                               started)
        if tier == "local":  # an object store: only its commit survives the node
            tier, extra["steps_lost"] = self._settle_upload(notice, step, saved_step)
            extra["durable_tier"] = tier
            if tier == "local":
                extra["object_step"] = step - extra["steps_lost"]
        if ok:
            t1 = time.monotonic()
            for hook in self.drain_hooks:
                try:
                    hook(step, notice)
                except Exception:  # the checkpoint is durable; leave anyway
                    log.exception("@on_drain hook %s failed", getattr(hook, "__name__", hook))
            drain_seconds = time.monotonic() - t1
            self._report(notice, saved_step, "drained", drain_seconds, extra)
        code = EXIT_PREEMPTED if ok else EXIT_CHECKPOINT_FAILED
        write_termination_message(notice.id, step, saved_step, ok, steps_lost=extra["steps_lost"],
                                  durable_tier=extra.get("durable_tier"), object_step=extra.get("object_step"))
        log.warning("rank %d drained for notice %s at step %d (checkpoint of step %d %s in %.3fs): exit %d",
                    self.collectives.rank, notice.id, step, saved_step, "durable" if ok else "FAILED",
                    checkpoint_seconds, code)
        return DrainRecord(step, saved_step, notice, used_snapshot, ok, code, checkpoint_seconds, drain_seconds,
                           started)

    def _start_checkpoint(self, step: int, notice: Notice) -> tuple[int, bool, Future]:
        """The save started: (the step saved, whether the snapshot was used, the write's Future)."""
        adapter, saved_step, used_snapshot = self.adapter, step, False
        if adapter is None:
            if not self.reclaim_hooks:
                log.warning("notice %s: no adapter and no @on_reclaim hook, nothing was saved", notice.id)
            return saved_step, used_snapshot, done_future(lambda: None)
        used_snapshot = self._use_snapshot(adapter, notice)
        if used_snapshot:
            if isinstance(adapter, StoreAdapter):
                saved_step, write = adapter.persist_snapshot_behind(reason="notice", notice=notice)
            else:
                saved_step, write = adapter.persist_snapshot(reason="notice", notice=notice), done_future(lambda: None)
            log.warning("deadline too close for a fresh save: persisted the in-memory snapshot of step %d "
                        "(agreed at step %d, %d steps lost)", saved_step, step, step - saved_step)
        elif isinstance(adapter, StoreAdapter):
            write = adapter.save_behind(step, reason="notice", notice=notice)
        else:
            write = done_future(lambda: adapter.save(step, reason="notice", notice=notice))
        return saved_step, used_snapshot, write

    def _tier(self, saved_step: int) -> str | None:
        """Where the notice checkpoint is durable now, for a store with tiers (None: not told)."""
        tier_of = getattr(getattr(self.adapter, "store", None), "durable_tier", None)
        return tier_of(tag_for(saved_step, "notice")) if callable(tier_of) else None

    def _settle_upload(self, notice: Notice, step: int, saved_step: int) -> tuple[str | None, int]:
        """Waits for the upload until the notice's deadline (less the margin); the tier then, and
        the steps lost counting only what reached the object store (the newest step this process
        knows there, else all of them)."""
        store: Any = getattr(self.adapter, "store", None)
        left = notice.seconds_left()
        store.wait_uploaded(None if left is None else max(left - self.save_margin_seconds, 0.0))
        tier = self._tier(saved_step)
        if tier == "object":
            return tier, step - saved_step
        survived = getattr(store, "object_step", None)
        log.warning("checkpoint of step %d is on local disk only (not uploaded by the deadline): lost with the node",
                    saved_step)
        return tier, step - (survived if survived is not None else 0)

    def _use_snapshot(self, adapter: CheckpointAdapter, notice: Notice) -> bool:
        """The save decision's vote; skipped (a fresh save, no collective) for an adapter whose
        `takes_snapshots` is False (a class attribute, so the same on every rank: it never holds
        a snapshot, and the vote could only choose a fresh save)."""
        if not getattr(adapter, "takes_snapshots", True):
            return False
        left = notice.seconds_left()
        estimate = adapter.estimate_save_seconds()
        vote = save_decision.vote(left, estimate, self.save_margin_seconds, adapter.snapshot_step)
        choice = save_decision.decide(self.collectives.max(vote))
        if choice is save_decision.SaveChoice.NO_COMMON_SNAPSHOT:
            log.warning("deadline too close for a fresh save (%.2fs left, estimate %.2fs) but no common snapshot: "
                        "saving fresh", left if left is not None else float("nan"), estimate or 0.0)
        return choice is save_decision.SaveChoice.SNAPSHOT

    def _report(self, notice: Notice, saved_step: int, phase: str, seconds: float, extra: dict) -> None:
        if self.reporter is not None:
            self.reporter.report(notice.id, saved_step, phase, seconds, **extra)


class ReturnToLoop:
    """After a drain `step()` returns True; the training code decides what follows."""

    def after_drain(self, record: DrainRecord) -> bool:
        return True

    def release(self) -> None:
        pass


class ExitProcess:
    """After a drain the rank exits with the record's code (see the module docstring)."""

    def __init__(self, close: Callable[[], None], leave: Callable[[], None], hard_exit: bool = True):
        self._close = close
        self._leave = leave
        self._hard_exit = hard_exit
        self._code: int | None = None
        atexit.register(self._exit_after_drain)

    def after_drain(self, record: DrainRecord) -> bool:
        if self._hard_exit:
            self._code = record.exit_code
        self._close()
        self._leave()
        raise SystemExit(record.exit_code)

    def release(self) -> None:
        """The Guard closes without a drain: the atexit hook goes."""
        if self._code is None:
            atexit.unregister(self._exit_after_drain)

    def _exit_after_drain(self) -> None:
        if self._code is None:
            return
        flush_and_exit(self._code)
