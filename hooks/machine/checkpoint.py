"""The checkpoint of an agreed step, in three calls, for every walk that saves (a drain, either
side of a shrink, a grow's survivors).

`Checkpoint(effects, step, notice, for_notice)`:
- `start()` (collective over the old group): for a notice's checkpoint, the notice is marked
  answered and the save decision votes (`save_decision`; none for an adapter whose
  `takes_snapshots` is False): a fresh `adapter.save_behind(step)` or
  `adapter.persist_snapshot_behind()`; a grow's own save is always fresh. It returns once the
  state is copied, its durable write running behind. A save that raises fails the write: every
  rank learns it in `finish`.
- `finish(limit)` (collective again): waits at most `limit` for the write (durable and committed
  by every rank, the store's commit protocol), runs the `@on_reclaim` hooks `hook(step, notice)`
  (a notice's checkpoint), then `all_ok`: the checkpoint counts only when every rank succeeded
  (a hook may fail on one rank); reports `checkpoint-durable` (or `failed`) with the seconds
  taken. Returns the `Saved`. A write that failed failed on every rank (its commit protocol says
  so on all of them), so there is no vote then: a peer that stopped answering and failed the
  write is never waited for a second time. A write not done within `limit` counts as failed
  here: the peers that still wait learn it when this rank leaves its groups.
- `abandon(limit)`: a failed walk's end (its groups may be broken): waits at most `limit` for the
  write alone, never a collective, never a hook, and records it (durable when the write's own
  commit protocol said so, on every rank alike). After `finish`, both return its `Saved`.
With `channel` (a `StoreChannel` on the old formation's store, for an adapter whose
`writes_over_channel`) the write and its commit run through it, never a group: the save outlives
the group it started on. `hooks_now()` (collective, on that group, right after `start`) runs the
`@on_reclaim` hooks and their vote while the group is there; `finish(limit, linger)` then waits
for the write alone (its commit protocol tells every rank the same outcome) and may run after
this rank formed another group, as may `abandon` (the same then); `linger`: how long it waits,
after a durable write, until every rank's write read its last round of the channel (the old
formation's rank 0 serves the store, and may be about to exit). A write this rank gives up on
aborts the channel: the peers' waits end at once.
A SystemExit or KeyboardInterrupt inside a save or hook propagates; anything else fails it.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from spotguard.hooks import save_decision
from spotguard.hooks.adapters.base import CheckpointAdapter, checkpoint_tag, done_future, reraise_interrupts
from spotguard.hooks.checkpoint.store_channel import StoreChannel
from spotguard.hooks.checkpoint.types import TieredStore
from spotguard.hooks.machine.effects import Effects
from spotguard.hooks.machine.model import Saved
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.guard")
_warned_early_hooks: list[bool] = []  # the timing of @on_reclaim in an ahead shrink is said once per process


class Checkpoint:
    """See the module docstring."""

    def __init__(self, effects: Effects, step: int, notice: Notice, for_notice: bool,
                 channel: StoreChannel | None = None):
        self.effects, self.step, self.notice, self.for_notice = effects, step, notice, for_notice
        self.channel = channel
        self._hooks_ok: bool | None = None  # the hooks' vote, when `hooks_now` ran it
        self.saved_step, self.used_snapshot = step, False
        self.started_at, self._t0 = time.time(), time.monotonic()
        self.write: Future | None = None
        self.saved: Saved | None = None

    def start(self) -> None:
        """See the module docstring."""
        self.started_at, self._t0 = time.time(), time.monotonic()
        try:
            self.saved_step, self.used_snapshot, self.write = self._begin()
        except BaseException as exc:  # the vote in `finish` tells every rank
            reraise_interrupts(exc)
            failed: Future = Future()
            failed.set_exception(exc)
            self.write = failed

    def finish(self, limit: float, linger: float = 0.0) -> Saved:
        """See the module docstring."""
        if self.saved is not None:
            return self.saved
        ok = self._written(limit)
        if self._hooks_ok is not None:  # voted in `hooks_now`, on the group that is gone by now
            ok = ok and self._hooks_ok
        elif ok:
            ok = self.effects.collectives().all_ok(self._reclaim_hooks() if self.for_notice else True)
        if self.channel is not None and ok and linger > 0:
            self.channel.wait_closed(linger)
        elif self.channel is not None and not ok:  # the write in flight gives up now, and tells the peers
            self.channel.abort(f"gave up on the checkpoint of step {self.saved_step}")
        self.saved = self._record(ok)
        if self.for_notice:
            extra: dict = {"steps_lost": self.step - self.saved_step, "saved_step": self.saved_step}
            if self.saved.tier is not None:
                extra["durable_tier"] = self.saved.tier
            self.report("checkpoint-durable" if ok else "failed", self.saved.seconds, **extra)
        return self.saved

    def hooks_now(self) -> None:
        """Collective on the current group: the `@on_reclaim` hooks and their vote now, while the
        write runs (for a checkpoint whose `finish` comes after this group is gone)."""
        if self.for_notice and self.effects.hooks.reclaim and not _warned_early_hooks:
            _warned_early_hooks.append(True)
            log.warning("@on_reclaim hooks run while this in-place shrink's checkpoint still commits (it outlives "
                        "the old group, the hooks run on it); work that needs the checkpoint durable belongs in "
                        "@on_drain (the leaving ranks) or @on_resize (the staying ones)")
        ok = self._reclaim_hooks() if self.for_notice else True
        self._hooks_ok = self.effects.collectives().all_ok(ok)

    def abandon(self, limit: float) -> Saved:
        """See the module docstring."""
        if self.saved is None and self._hooks_ok is not None:  # nothing left to vote on: as `finish`
            return self.finish(limit)
        if self.saved is None:
            self.saved = self._record(self.write is not None and self._written(limit))
            if self.channel is not None and not self.saved.durable:
                self.channel.abort(f"abandoned the checkpoint of step {self.saved_step}")
        return self.saved

    def report(self, phase: str, seconds: float, **extra: object) -> None:
        """One report of this checkpoint to the sidecar (a notice's checkpoint only)."""
        reporter = self.effects.reporter
        if reporter is not None and self.for_notice:
            reporter.report(self.notice.id, self.saved_step, phase, seconds, **extra)

    # ---- the parts --------------------------------------------------------------------------
    def _begin(self) -> tuple[int, bool, Future]:
        """The save started: (the step saved, whether the snapshot was used, the write's Future)."""
        adapter, step, notice = self.effects.adapter(), self.step, self.notice
        if self.for_notice:
            self.effects.answered(notice.id)  # a re-sent or updated copy does not drain again
        if adapter is None:
            if not self.effects.hooks.reclaim:
                log.warning("notice %s: no adapter and no @on_reclaim hook, nothing was saved", notice.id)
            return step, False, done_future(lambda: None)
        over = {"channel": self.channel} if self.channel is not None else {}
        if not self.for_notice:
            return step, False, adapter.save_behind(step, reason="membership", notice=notice, **over)
        if self._use_snapshot(adapter):
            saved_step, write = adapter.persist_snapshot_behind(reason="notice", notice=notice, **over)
            log.warning("deadline too close for a fresh save: persisted the in-memory snapshot of step %d "
                        "(agreed at step %d, %d steps lost)", saved_step, step, step - saved_step)
            return saved_step, True, write
        return step, False, adapter.save_behind(step, reason="notice", notice=notice, **over)

    def _use_snapshot(self, adapter: CheckpointAdapter) -> bool:
        """The save decision's vote; skipped (a fresh save, no collective) for an adapter whose
        `takes_snapshots` is False (a class attribute, so the same on every rank: it never holds
        a snapshot, and the vote could only choose a fresh save)."""
        if not getattr(adapter, "takes_snapshots", True):
            return False
        left = self.notice.seconds_left()
        estimate = adapter.estimate_save_seconds()
        vote = save_decision.vote(left, estimate, self.effects.save_margin_seconds, adapter.snapshot_step)
        choice = save_decision.decide(self.effects.collectives().max(vote))
        if choice is save_decision.SaveChoice.NO_COMMON_SNAPSHOT:
            log.warning("deadline too close for a fresh save (%.2fs left, estimate %.2fs) but no common snapshot: "
                        "saving fresh", left if left is not None else float("nan"), estimate or 0.0)
        return choice is save_decision.SaveChoice.SNAPSHOT

    def _written(self, limit: float) -> bool:
        """Waits at most `limit` for the write; whether it is durable. No collective of its own."""
        assert self.write is not None
        try:
            self.write.result(timeout=max(limit, 0.0))
            return True
        except TimeoutError:
            log.error("checkpoint of step %d for notice %s not durable within %.1fs: counted as failed",
                      self.saved_step, self.notice.id, limit)
            return False
        except BaseException as exc:  # DCP's CheckpointException derives from BaseException
            reraise_interrupts(exc)
            log.exception("checkpoint of step %d for notice %s failed", self.saved_step, self.notice.id)
            return False

    def _reclaim_hooks(self) -> bool:
        try:
            for hook in self.effects.hooks.reclaim:
                hook(self.step, self.notice)
        except BaseException as exc:
            reraise_interrupts(exc)
            log.exception("@on_reclaim hook for notice %s at step %d failed on rank %d", self.notice.id, self.step,
                          self.effects.collectives().rank)
            return False
        return True

    def _record(self, ok: bool) -> Saved:
        return Saved(self.saved_step, ok, self.used_snapshot, time.monotonic() - self._t0, self.started_at,
                     self.for_notice, self.tier() if ok else None)

    def tier(self) -> str | None:
        """Where this checkpoint is durable now, for a store with tiers (None: not told)."""
        adapter = self.effects.adapter()
        store = getattr(adapter, "store", None)
        if not isinstance(store, TieredStore):
            return None
        reason = "notice" if self.for_notice else "membership"
        return store.durable_tier(checkpoint_tag(adapter, self.saved_step, reason))
