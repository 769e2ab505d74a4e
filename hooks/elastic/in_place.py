"""The Guard's in-place side: which agreed notice or membership changes the group, running the
change (`reformer`), and what a change leaves behind (the view's generation, a joiner's state).

Contract (every method on the training thread; the collective ones on every rank in one order):
- `InPlace(on_phase)`: the membership view from the environment and a `Reformer` on this
  process's rendezvous (`join.init_process_group`'s, or one from the environment).
- `learn(collectives)` (collective, after every formation): the group's hosts; a joiner adopts
  the generation it joined, a start-at-min worker the one it started with.
- `owes_state()`: this process joined a running group and has not received its state yet.
- `change_for(collectives, adapter, notice, step)` (collective for a membership): the `Change`
  the agreed notice asks for; `Settled` when it asks nothing (the view adopts the generation);
  None when every rank drains (no resizable adapter, a membership that cannot be a group).
  Whether an agreed membership settles is rank 0's word on every rank: the stale rule compares
  times read on different ranks' clocks, which must not split the group.
- `run(seam, step, notice, change)`: the change (`Reformer.run`), then the view's bookkeeping;
  the record's `drain` is the checkpoint the change wrote (a failed one when its save raised).
- `receive_state(seam)`: the joiner's half (`Reformer.join`); the step to start from.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

from spotguard.hooks.adapters.base import StoreAdapter, done_future, resizable_adapter
from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.drain import DrainRecord, PendingCheckpoint
from spotguard.hooks.elastic.join import elastic_process
from spotguard.hooks.elastic.membership_view import MEMBERSHIP_SOURCE, Change, MembershipView, Settled
from spotguard.hooks.elastic.reformer import Outcome, Reformer, ResizeRecord, Seam
from spotguard.hooks.elastic.rendezvous import Rendezvous
from spotguard.wire.names import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.elastic")


class InPlace:
    """See the module docstring."""

    def __init__(self, on_phase: Any = None, view: MembershipView | None = None, reformer: Reformer | None = None):
        process = elastic_process()
        self.view = view if view is not None else MembershipView.from_env()
        self.reformer = reformer if reformer is not None else Reformer(
            process.rendezvous if process is not None else Rendezvous.from_env(), on_phase)

    def learn(self, collectives: Collectives) -> None:
        self.view.learn_hosts(collectives)
        process = elastic_process()
        first = None if process is None else process.joined or process.started
        if first is not None:
            self.view.adopt(first.generation)

    @staticmethod
    def owes_state() -> bool:
        process = elastic_process()
        return process is not None and process.joined is not None and not process.state_received

    def change_for(self, collectives: Collectives, adapter: Any, notice: Notice, step: int) -> Change | Settled | None:
        if resizable_adapter(adapter) is None:
            return None
        try:
            change = self.view.plan_for(notice, step)
            if notice.source == MEMBERSHIP_SOURCE:
                change = self._rank0_settles(collectives, notice, step, change)
        except ValueError as exc:  # a membership that cannot be a group: drain as before
            log.error("membership change not possible in place (%s): draining", exc)
            return None
        if isinstance(change, Settled):  # every rank: the same agreed notice, the same group
            self.view.adopt(change.generation)
            log.warning("membership %d needs no change (%s): training goes on", change.generation, change.why)
        return change

    def _rank0_settles(self, collectives: Collectives, notice: Notice, step: int,
                       change: Change | Settled | None) -> Change | Settled | None:
        mine = change.why.encode() if isinstance(change, Settled) else b""
        word = collectives.broadcast_bytes(mine, 0)
        if bool(word) == bool(mine):
            return change
        if word:
            return Settled(int(notice.detail["generation"]), word.decode(errors="replace"))
        return self.view.plan_for(notice, step, settle=False)

    def run(self, seam: Seam, step: int, notice: Notice, change: Change) -> ResizeRecord:
        record = self.reformer.run(seam, step, notice, change)
        if record.drain is None:  # the checkpoint itself raised: nothing is durable
            record.drain = DrainRecord(step, step, notice, False, False, EXIT_CHECKPOINT_FAILED, 0.0, 0.0,
                                       record.started_at)
        if notice.source == MEMBERSHIP_SOURCE:
            self.view.adopt(change.generation)
        if record.outcome is Outcome.CONTINUE:
            self.view.after_change(change.plan, record.started_at)
            log.warning("in place at step %d: world %d -> %d, rank %d -> %d, paused %.3fs", step,
                        record.old_world_size, record.new_world_size, record.old_rank, record.new_rank,
                        record.pause_seconds)
        return record

    def receive_state(self, seam: Seam) -> int:
        if resizable_adapter(seam.adapter) is None:
            raise RuntimeError("a joiner needs an adapter made with build= before resume()")
        record = self.reformer.join(seam)
        process = elastic_process()
        assert process is not None
        process.state_received = True
        log.warning("joined in place: state of step %d from a live peer, now rank %d of %d", record.step,
                    seam.collectives.rank, seam.collectives.world_size)
        return record.step + 1


def start_save_before_grow(collectives: Collectives, adapter: Any, step: int, notice: Notice) -> PendingCheckpoint:
    """The old group (every rank survives a grow) saves the agreed step, so a failure at any
    point of the change, a survivor's death included, falls back to it without another group.
    Returns after the copy (collective), the write running behind; `finish()` waits for it and
    votes over the old group (collective)."""
    started, t0 = time.time(), time.monotonic()
    try:
        write = (adapter.save_behind(step, reason="membership", notice=notice) if isinstance(adapter, StoreAdapter)
                 else done_future(lambda: adapter.save(step, reason="membership", notice=notice)))
    except Exception as exc:  # the copy itself failed: the vote says so on every rank
        write = Future()
        write.set_exception(exc)

    def finish(pending: PendingCheckpoint) -> DrainRecord:
        ok = collectives.all_ok(pending.written())
        return DrainRecord(step, step, notice, False, ok, EXIT_PREEMPTED if ok else EXIT_CHECKPOINT_FAILED,
                           time.monotonic() - t0, 0.0, started)

    return PendingCheckpoint(step, step, notice, False, started, t0, write, finish)
