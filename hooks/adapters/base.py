"""The `CheckpointAdapter` protocol the Guard drives, and `StoreAdapter`, what every adapter shares:
the store, the commit protocol across ranks, save timing, snapshots.

An adapter is made on its own (`checkpoint_dir=` or `store=`) and handed to the Guard
(`Guard.from_env(adapter=...)` or `guard.attach(adapter)`); it never needs the Guard.

Contract for subclasses. An adapter on the snapshot engine (checkpoint/engine.py: every adapter
here) implements `_state(step)` (the live state tree to copy: tensors, and plain values) and
`_write_state(pending, state)` (this rank's files from that tree, whose tensors are the engine's
buffers); an adapter whose framework writes its own files (the integrations) implements
`_write(pending, step)` instead. Both implement `_load(info)`. The base class then gives the Guard's
`CheckpointAdapter` interface:
- `save(step, reason=..., notice=...)`: collective. On the engine: the state is copied into the
  buffers (the only time training is held; it is also the held snapshot of `step`), then the
  engine persists that copy through the store: begins `step-<step>-<reason>`, writes,
  `finish_rank`, agrees that every rank finished, rank 0 commits with metadata {step, reason,
  notice_id, world_size, extra}, every rank learns the outcome. Durable when it returns; raises
  `CheckpointFailed` on every rank when any rank failed (so no rank waits forever for a commit).
- `save_async(step)`: the same copy now, the persist and commit in the background (`wait()`,
  `async_error`); `snapshot(step)` / `persist_snapshot(...)`: the copy alone, and later its commit.
- `save_behind(step, ...)` / `persist_snapshot_behind(...)`: a save (a persist of the held
  snapshot) that returns after the copy with the Future of its commit (an in-place change writes
  its checkpoint while the state moves); the next save, snapshot or `rebuild` waits for it.
- `prepare()`: allocates the buffers now (call once after the first optimizer step, so that no
  notice pays for it); `save_parts()`: measured seconds of each part (snapshot, persist).
- `estimate_save_seconds()`: 1.25 x (slowest recent snapshot + slowest recent persist) on the
  engine, else 1.25 x the slowest of the last 5 measured fresh saves.
- `resume()`: the newest complete, verified checkpoint -> `_load`, `resumed_metadata`,
  `extra` (the dict `extra_state()` returned at save time); returns `step + 1`.
- `answered_notice_id()`: the notice the resumed checkpoint was saved for; `gradient_carrier()`:
  None (an adapter of a DDP model returns the model); `held_snapshot`: the last snapshot's state.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable
from collections.abc import Callable

from spotguard.hooks.adapters.store import (CheckpointFailed, CheckpointInfo, PartTimes, Snapshot, SnapshotEngine,
                                             Store, open_store)
from spotguard.wire.notice import Notice

log = logging.getLogger("spotguard.hooks.adapters")


class CheckpointAdapter(Protocol):
    """What the Guard needs from a framework adapter. Collective calls run on every rank, in the
    same order; "local" ones touch this rank only."""

    snapshot_step: int | None  # the step of the last in-memory snapshot (None: none taken)

    def save(self, step: int, *, reason: str, notice: Notice | None = None) -> Any:
        """Collective: a fresh checkpoint of `step`, durable (committed) when it returns on every
        rank; raises on every rank when any rank failed."""

    def snapshot(self, step: int) -> None:
        """Local: keep an in-memory copy of the state after `step` (same steps on every rank)."""

    def persist_snapshot(self, *, reason: str, notice: Notice | None = None) -> int:
        """Collective: make the last snapshot a durable checkpoint; returns its step."""

    def estimate_save_seconds(self) -> float | None:
        """Expected seconds for a fresh save, from measured saves (None: no measurement yet)."""

    def resume(self) -> int | None:
        """Collective: loads the newest complete checkpoint; the step to start from, or None without one."""

    def answered_notice_id(self) -> str | None:
        """The id of the notice the checkpoint `resume()` loaded was saved for (None: none)."""

    def gradient_carrier(self) -> Any:
        """A DDP model whose gradient all_reduce may carry the Guard's agreement, or None."""

    def close(self) -> None:
        """Waits for saves in flight and releases what the adapter holds."""


@runtime_checkable
class ResizableAdapter(CheckpointAdapter, Protocol):
    """What an in-place membership change needs besides the checkpoint (`hooks/elastic`): an
    adapter that can rebuild its model for another world size and carry the state across.
    `resizable_adapter(adapter)` is the one check the Guard makes."""

    resizable: bool  # False: made without what a rebuild needs (TorchDCPAdapter without build=)
    extra: dict[str, Any]  # the extras a resume or a live peer handed over

    def extra_state_now(self) -> dict[str, Any]:
        """Local: the user's extras as they are now (`extra_state()`, or {})."""

    def full_state(self) -> dict[str, Any]:
        """Collective over the old group: the state a new group is made from."""

    def rebuild(self) -> None:
        """Collective over the new default group: a fresh model and optimizer for it."""

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Local: loads what `full_state()` returned into the rebuilt model and optimizer."""


def resizable_adapter(adapter: object) -> ResizableAdapter | None:
    """`adapter` as a ResizableAdapter when it can take an in-place change now, else None."""
    if isinstance(adapter, ResizableAdapter) and adapter.resizable:
        return adapter
    return None


def done_future(call: Callable[[], Any]) -> Future:
    """A Future already done with `call()`'s result or exception (a save without the engine)."""
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as exc:
        future.set_exception(exc)
    return future


def reraise_interrupts(exc: BaseException) -> None:
    """Re-raises what must not be swallowed (SystemExit, KeyboardInterrupt)."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        raise exc


def tag_for(step: int, reason: str) -> str:
    return f"step-{step:09d}-{reason}"


class StoreAdapter:
    """Base of the framework adapters; see the module docstring."""

    def __init__(self, *, checkpoint_dir: str | os.PathLike | None = None, store: Store | None = None,
                 keep_last: int = 3, extra_state: Callable[[], dict[str, Any]] | None = None):
        if store is None:
            if checkpoint_dir is None:
                raise ValueError("an adapter needs checkpoint_dir or a store")
            store = open_store(checkpoint_dir, keep_last=keep_last)
        self.store = store
        self.extra_state = extra_state
        self.extra: dict[str, Any] = {}
        self.resumed_metadata: dict[str, Any] | None = None
        self.snapshot_step: int | None = None
        self._snapshot: Snapshot | None = None
        self.snapshot_engine: SnapshotEngine | None = SnapshotEngine() if self._on_engine() else None
        self.save_seconds: deque[float] = deque(maxlen=5)
        self.last_info: CheckpointInfo | None = None
        self.async_error: BaseException | None = None
        self._setup_group()

    def _on_engine(self) -> bool:
        return type(self)._state is not StoreAdapter._state

    # ---- collectives: the formation's checkpoint group, which spotguard makes (control_group) --
    def _setup_group(self) -> None:
        import torch.distributed as dist

        from spotguard.hooks.agreement.control_group import control_groups

        self.rank, self.world_size, self._group = 0, 1, None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            groups = control_groups()
            self._group = groups.checkpoint if groups is not None else None

    def _all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank (one all_reduce MIN)."""
        if self._group is None:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _barrier(self) -> None:
        self._all_ok(True)

    def _agreed_attempt(self) -> str:
        """One fresh id for this save, the same on every rank (one all_reduce MAX of random numbers):
        a store with `agrees_attempts` keeps parts of different attempts at one tag apart."""
        mine = secrets.randbits(62)
        if self._group is None:
            return f"{mine:016x}"
        import torch
        import torch.distributed as dist

        value = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group)
        return f"{int(value.item()):016x}"

    # ---- subclass hooks --------------------------------------------------------------------
    def _state(self, step: int) -> Any:
        """The live state to copy at `step` (adapters on the engine)."""
        raise NotImplementedError

    def _write_state(self, pending, state: Any) -> None:
        """This rank's files of `state`, a tree over the engine's buffers (adapters on the engine)."""
        raise NotImplementedError

    def _write(self, pending, step: int) -> None:
        """This rank's files for a fresh save of `step` (adapters whose framework writes them itself)."""
        raise NotImplementedError

    def _load(self, info: CheckpointInfo) -> None:
        raise NotImplementedError

    def _metadata_extra(self) -> dict[str, Any]:
        return {}

    def _tag(self, step: int, reason: str) -> str:
        """The store's name of the checkpoint of `step` (a framework integration uses the framework's)."""
        return tag_for(step, reason)

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Rank 0, right after the commit: a failure here fails the checkpoint on every rank."""

    # ---- the engine -------------------------------------------------------------------------
    def _require_engine(self) -> SnapshotEngine:
        if self.snapshot_engine is None:
            raise CheckpointFailed(f"{type(self).__name__} takes no in-memory snapshots")
        return self.snapshot_engine

    def _copy(self, step: int) -> Snapshot:
        """The snapshot of `step` (the stall); it becomes the held snapshot."""
        engine = self._require_engine()
        extra = self.extra_state() if self.extra_state else {}
        self._snapshot, self.snapshot_step = None, None  # the buffers are about to change
        snap = engine.snapshot(lambda: self._state(step), step=step, extra=extra)
        self._snapshot, self.snapshot_step = snap, step
        return snap

    def _persist(self, snap: Snapshot | None, step: int, reason: str, notice: Notice | None, *,
                 snapshot: bool, failure: BaseException | None = None) -> Any:
        """The engine's background persist of `snap` through the store's commit (a Future).
        With `failure` (this rank could not take the snapshot) every rank still runs the commit
        protocol, so all of them learn that this checkpoint failed."""
        engine = self._require_engine()
        extra = snap.extra if snap is not None else {}

        def write(pending) -> None:
            if failure is not None or snap is None:
                raise CheckpointFailed(f"rank {self.rank}: no snapshot of step {step}") from failure
            self._write_state(pending, snap.state)

        def commit(_state: Any) -> CheckpointInfo | None:
            return self._checkpoint(step, reason, notice, extra, write, snapshot=snapshot)

        if snap is None:
            return engine.submit(lambda: commit(None))
        return engine.persist(snap, commit)

    def _fresh(self, step: int, reason: str, notice: Notice | None) -> Any:
        """Snapshot now, persist in the background: the Future of the commit."""
        self.wait()
        try:
            snap: Snapshot | None = self._copy(step)
            failure = None
        except BaseException as exc:
            reraise_interrupts(exc)
            log.exception("rank %d could not copy the state of step %d", self.rank, step)
            snap, failure = None, exc
        return self._persist(snap, step, reason, notice, snapshot=False, failure=failure)

    def prepare(self) -> None:
        """Allocates the snapshot buffers now (a copy of the current state, not a checkpoint).
        Call after the first optimizer step, on every rank (DeepSpeed's copy is collective)."""
        engine = self._require_engine()
        self.wait()
        engine.snapshot(lambda: self._state(-1), step=-1, timed=False)
        engine.forget()
        self._snapshot, self.snapshot_step = None, None

    def save_parts(self) -> PartTimes:
        """Measured seconds of each part of a save (snapshot, persist); None where not measured."""
        return self.snapshot_engine.estimate() if self.snapshot_engine is not None else PartTimes(None, None)

    # ---- the CheckpointAdapter interface ----------------------------------------------------
    def save(self, step: int, *, reason: str = "periodic", notice: Notice | None = None) -> CheckpointInfo | None:
        t0 = time.monotonic()
        if self.snapshot_engine is None:
            extra = self.extra_state() if self.extra_state else {}
            info = self._checkpoint(step, reason, notice, extra, lambda pending: self._write(pending, step))
        else:
            info = self._fresh(step, reason, notice).result()
        self.save_seconds.append(time.monotonic() - t0)
        return info

    def save_behind(self, step: int, *, reason: str = "periodic", notice: Notice | None = None) -> Future:
        """Collective: `save`, but returns once the state is copied (the stall); the Future is done
        when the commit is (its result the CheckpointInfo; CheckpointFailed on every rank when any
        rank failed). Without the engine the save runs now and the Future is done already."""
        if self.snapshot_engine is None:
            return done_future(lambda: self.save(step, reason=reason, notice=notice))
        t0 = time.monotonic()
        future = self._fresh(step, reason, notice)

        def timed(finished: Future) -> None:
            if finished.exception() is None:
                self.save_seconds.append(time.monotonic() - t0)

        future.add_done_callback(timed)
        return future

    def persist_snapshot_behind(self, *, reason: str = "notice", notice: Notice | None = None) -> tuple[int, Future]:
        """`persist_snapshot`, returning at once: (the held snapshot's step, the Future of its commit)."""
        snap = self._snapshot
        if self.snapshot_step is None or snap is None or not snap.valid:
            raise CheckpointFailed("no snapshot to persist")
        return snap.step, self._persist(snap, snap.step, reason, notice, snapshot=True)

    def save_async(self, step: int, *, reason: str = "periodic") -> None:
        """Collective: copies the state now; persists and commits it in the background. The next
        save, snapshot or `wait()` waits for it; a failure is logged and kept in `async_error`."""
        t0 = time.monotonic()
        future = self._fresh(step, reason, None)

        def done(finished) -> None:
            error = finished.exception()
            if error is None:
                self.save_seconds.append(time.monotonic() - t0)
            else:
                self.async_error = error
                log.error("async checkpoint of step %d failed: %s", step, error)

        future.add_done_callback(done)

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the persist in flight (if any) to be committed or to fail."""
        if self.snapshot_engine is not None:
            self.snapshot_engine.wait(timeout)

    def snapshot(self, step: int) -> None:
        self._copy(step)

    def persist_snapshot(self, *, reason: str = "notice", notice: Notice | None = None) -> int:
        snap = self._snapshot
        if self.snapshot_step is None or snap is None or not snap.valid:
            raise CheckpointFailed("no snapshot to persist")
        self._persist(snap, snap.step, reason, notice, snapshot=True).result()
        return snap.step

    @property
    def held_snapshot(self) -> Any:
        """The last snapshot's state, a tree over the engine's buffers (None before the first)."""
        snap = self._snapshot
        return snap.state if snap is not None and snap.valid else None

    def answered_notice_id(self) -> str | None:
        return (self.resumed_metadata or {}).get("notice_id") or None

    def extra_state_now(self) -> dict[str, Any]:
        return self.extra_state() if self.extra_state else {}

    def gradient_carrier(self) -> Any:
        return None

    def close(self) -> None:
        if self.snapshot_engine is not None:
            self.snapshot_engine.close()

    def estimate_save_seconds(self) -> float | None:
        fresh = self.save_parts().fresh
        if fresh is not None:
            return 1.25 * fresh
        return 1.25 * max(self.save_seconds) if self.save_seconds else None

    def resume(self) -> int | None:
        info = self.store.resolve(verify=True)
        if info is None:
            return None
        self._barrier()  # every rank sees the same newest checkpoint before anyone loads
        self._load(info)
        self.resumed_metadata = dict(info.metadata)
        self.extra = dict(info.metadata.get("extra") or {})
        log.info("resumed from checkpoint %s (step %s, saved by %s ranks)", info.tag, info.step, info.world_size)
        return int(info.metadata["step"]) + 1

    # ---- the commit protocol ---------------------------------------------------------------
    def _checkpoint(self, step: int, reason: str, notice: Notice | None, extra: dict[str, Any],
                    write: Callable[[Any], None], snapshot: bool = False, pending: Any = None) -> CheckpointInfo | None:
        tag = self._tag(step, reason)
        ok = True
        attempt = self._agreed_attempt() if pending is None and getattr(self.store, "agrees_attempts", False) else None
        try:
            if pending is None:
                pending = self.store.begin(tag, attempt=attempt)
            write(pending)
            pending.finish_rank(self.rank)
        except BaseException as exc:  # every rank must learn about the failure
            reraise_interrupts(exc)  # (DCP's CheckpointException derives from BaseException)
            log.exception("rank %d could not write its part of checkpoint %s", self.rank, tag)
            ok = False
        if not self._all_ok(ok):
            if pending is not None:  # every rank stopped writing: the next open's cleanup may remove it
                pending.close()
            raise CheckpointFailed(f"checkpoint {tag}: a rank failed to write its part")
        info, ok = None, True
        if self.rank == 0:
            metadata = {"step": step, "reason": reason, "notice_id": notice.id if notice else None,
                        "world_size": self.world_size, "snapshot": snapshot, "extra": extra,
                        **self._metadata_extra()}
            try:
                info = self.store.commit(tag, world_size=self.world_size, metadata=metadata)
                self._after_commit(info)
            except BaseException as exc:
                reraise_interrupts(exc)
                log.exception("commit of checkpoint %s failed", tag)
                ok = False
        if not self._all_ok(ok):
            raise CheckpointFailed(f"checkpoint {tag}: commit failed")
        self.last_info = info
        return info
