"""The `CheckpointAdapter` protocol the Guard drives, and `StoreAdapter`, what every adapter shares:
the store, save timing, snapshots, and the commit protocol across ranks (checkpoint/commit.py) each
save runs.

An adapter is made on its own (`checkpoint_dir=` or `store=`) and handed to the Guard
(`Guard.from_env(adapter=...)` or `guard.attach(adapter)`); it never needs the Guard.

Contract for subclasses. Every adapter saves on the snapshot engine (checkpoint/engine.py): it
implements `_state(step)` (the live state tree to copy: tensors, and plain values),
`_write_state(pending, state)` (this rank's files from that tree, whose tensors are the engine's
buffers, into a `PendingCheckpoint`) and `_load(info)`. The base class then gives the Guard's
`CheckpointAdapter` interface:
- `save(step, reason=..., notice=...)`: collective. The state is copied into the buffers (the only
  time training is held; it is also the held snapshot of `step`), then the engine persists that
  copy through the commit protocol (`CollectiveCommit` on the formation's checkpoint group): every
  rank writes its part of `step-<step>-<reason>`, every rank learns that every part is written,
  rank 0 commits with metadata {step, reason, notice_id, world_size, snapshot, extra}, every rank
  learns the outcome. Durable when it returns; raises `CheckpointFailed` on every rank when any
  rank failed (so no rank waits forever for a commit).
- `save_async(step)`: the same copy now, the persist and commit in the background (`wait()`,
  `async_error`: also set when an upload to the object store failed for good);
  `snapshot(step)` / `persist_snapshot(...)`: the copy alone, and later its commit.
- `save_behind(step, ...)` / `persist_snapshot_behind(...)`: a save (a persist of the held
  snapshot) that returns after the copy with the Future of its commit (an in-place change writes
  its checkpoint while the state moves); the next save, snapshot or `rebuild` waits for it.
- `prepare()`: allocates the buffers now, sized to this rank's shard (collective: every rank at
  the same step; DeepSpeed's copy is collective); a no-op while `prepared` (True after it or
  any other copy of the state, False again after a `rebuild` or `close`). The Guard calls it at
  its first step boundary and the first after each in-place change (`prepare_at_boundary`), so
  no notice save, snapshot or change allocates them; calling it earlier is still allowed.
  `save_parts()`: measured seconds of each part (snapshot, persist).
- `estimate_save_seconds()`: 1.25 x (slowest recent snapshot + slowest recent persist), else
  1.25 x the slowest of the last 5 measured fresh saves.
- `resume()`: the newest complete, verified checkpoint -> `_load`, `resumed_metadata`,
  `extra` (the dict `extra_state()` returned at save time); returns `step + 1`.
- `data=` (an `ElasticSampler`, or anything with a JSON `state_dict()` / `load_state_dict()` that
  is the same on every rank): its position is saved with every checkpoint and snapshot (in the
  metadata's extras, under `DATA_KEY`) and handed to a joiner in place (`extra_state_now()`);
  assigning `extra` (a resume, a live peer's hand-over) loads it back into `data` and leaves the
  user's extras alone in `extra`.
- `answered_notice_id()`: the notice the resumed checkpoint was saved for; `gradient_carrier()`:
  None (an adapter of a DDP model returns the model); `held_snapshot`: the last snapshot's state.
An adapter that can change its world size in place also implements `ResizableAdapter`.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from collections.abc import Callable

from spotguard.hooks.adapters.store import (CheckpointFailed, CheckpointInfo, PartTimes, PendingCheckpoint, Snapshot,
                                             SnapshotEngine, Store, open_store)
from spotguard.hooks.checkpoint.commit import CollectiveCommit, Vote, reraise_interrupts
from spotguard.hooks.checkpoint.store_channel import StoreChannel
from spotguard.wire.notice import Notice

if TYPE_CHECKING:
    import torch

    from spotguard.hooks.elastic.reshard_state import Shards

    class DataPosition(Protocol):
        """What `data=` takes: a position that is the same on every rank, as JSON."""

        def state_dict(self) -> dict[str, Any]: ...

        def load_state_dict(self, state: dict[str, Any]) -> None: ...

# CheckpointFailed (checkpoint/types.py) and reraise_interrupts (checkpoint/commit.py) were defined
# here: their old import path keeps working.
__all__ = [
    "DATA_KEY",
    "CheckpointAdapter",
    "CheckpointFailed",
    "ResizableAdapter",
    "StoreAdapter",
    "checkpoint_tag",
    "done_future",
    "prepare_at_boundary",
    "reraise_interrupts",
    "resizable_adapter",
    "tag_for",
]

log = logging.getLogger("spotguard.hooks.adapters")

DATA_KEY = "spotguard.data"  # the data position's key among the extras a checkpoint or a hand-over carries


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

    def save_behind(self, step: int, *, reason: str, notice: Notice | None = None) -> Future:
        """Collective: `save`, returning once the state is copied; the Future is done when the
        commit is (its exception: failed on every rank). The agreed-step machine saves with it."""

    def persist_snapshot_behind(self, *, reason: str, notice: Notice | None = None) -> tuple[int, Future]:
        """Collective: `persist_snapshot`, returning at once: (the snapshot's step, its commit's Future)."""

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
    adapter that can rebuild its model for another world size and carry the state across, peer to
    peer (`shard_state` -> `load_shards`, elastic/transfer.py's default) or gathered
    (`full_state` -> `load_full_state`, `SPOTGUARD_RESHARD=gather`).
    `resizable_adapter(adapter)` is the one check the Guard makes."""

    @property
    def resizable(self) -> bool:
        """False: made without what a rebuild needs (TorchDCPAdapter without build=)."""
    extra: dict[str, Any]  # the extras a resume or a live peer handed over

    def extra_state_now(self) -> dict[str, Any]:
        """Local: the user's extras as they are now (`extra_state()`, or {}), with the data
        position of `data=` (StoreAdapter); assigning them to a joiner's `extra` loads that position."""

    def full_state(self) -> dict[str, Any]:
        """Collective over the old group: the state a new group is made from."""

    def rebuild(self) -> None:
        """Collective over the new default group: a fresh model and optimizer for it."""

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Local: loads what `full_state()` returned into the rebuilt model and optimizer."""

    def shard_state(self) -> Shards:
        """Local: this rank's pieces of the model and optimizer state with their layouts
        (elastic/reshard_state.py), views of the live tensors; what the change moves peer to peer."""

    def shard_device(self) -> torch.device:
        """Local: where this rank's pieces live (a joiner allocates its new pieces there)."""

    def load_shards(self, manifest: dict[str, Any], pieces: dict[int, torch.Tensor]) -> None:
        """Local, after `rebuild()`: this rank's new pieces (manifest entry index -> piece, laid out
        for the current world size) become the model's parameters and the optimizer's state."""


def resizable_adapter(adapter: object) -> ResizableAdapter | None:
    """`adapter` as a ResizableAdapter when it can take an in-place change now, else None."""
    if isinstance(adapter, ResizableAdapter) and adapter.resizable:
        return adapter
    return None


def prepare_at_boundary(adapter: object) -> None:
    """The Guard's call at every step boundary: `adapter.prepare()` when the adapter has one and is
    not `prepared` (the Guard's first boundary, and the first after an in-place change gave this
    rank another shard: every rank of the group reaches it at the same step, so a collective copy
    is safe). A notice's save, a snapshot and a change's checkpoint then reuse the buffers. An
    allocation that fails (InsufficientHostMemory) is logged and not tried again until the next
    rebuild: the notice's save then allocates, or fails and says so, itself."""
    if adapter is None or getattr(adapter, "prepared", True):
        return
    try:
        adapter.prepare()  # type: ignore[attr-defined]
    except Exception:
        log.exception("the snapshot buffers could not be allocated at the step boundary: a notice's save will "
                      "try again")
        adapter.prepared = True  # type: ignore[attr-defined]  # tried: not at every step (module docstring)


def done_future(call: Callable[[], Any]) -> Future:
    """A Future already done with `call()`'s result or exception (a save that has no Future of its own)."""
    future: Future = Future()
    try:
        future.set_result(call())
    except Exception as exc:
        future.set_exception(exc)
    return future


def tag_for(step: int, reason: str) -> str:
    """The store's name of an adapter's checkpoint of `step` saved for `reason`."""
    return f"step-{step:09d}-{reason}"


def checkpoint_tag(adapter: Any, step: int, reason: str) -> str:
    """The store's name `adapter` gives its checkpoint of `step` saved for `reason` (a framework
    integration's own, such as the Trainer's `checkpoint-N`; `tag_for` for the others)."""
    name = getattr(adapter, "_tag", None)
    return name(step, reason) if callable(name) else tag_for(step, reason)


class StoreAdapter:
    """Base of the framework adapters; see the module docstring."""

    writes_over_channel = False  # its write can coordinate through a StoreChannel (`_write_state_over`)

    def __init__(self, *, checkpoint_dir: str | os.PathLike | None = None, store: Store | None = None,
                 keep_last: int = 3, extra_state: Callable[[], dict[str, Any]] | None = None,
                 data: DataPosition | None = None):
        if store is None:
            if checkpoint_dir is None:
                raise ValueError("an adapter needs checkpoint_dir or a store")
            store = open_store(checkpoint_dir, keep_last=keep_last)
        self.store = store
        self.extra_state = extra_state
        self.data = data
        self._extra: dict[str, Any] = {}
        self.resumed_metadata: dict[str, Any] | None = None
        self.snapshot_step: int | None = None
        self._snapshot: Snapshot | None = None
        self.snapshot_engine = SnapshotEngine()
        self.save_seconds: deque[float] = deque(maxlen=5)
        self.last_info: CheckpointInfo | None = None
        self.async_error: BaseException | None = None
        self.prepared = False  # the buffers are allocated for the current model and optimizer (`prepare`)
        listen = getattr(store, "add_failure_listener", None)  # a store with an object tier (uploads)
        if listen is not None:
            listen(self._upload_failed)
        self._setup_group()

    def _upload_failed(self, tag: str, error: BaseException) -> None:
        """An upload of checkpoint `tag` to the object store failed for good: the checkpoint stays on
        local disk only; kept in `async_error` like a failed background save."""
        self.async_error = error

    def _setup_group(self) -> None:
        """The collectives of the commit protocol: on the formation's checkpoint group, which
        spotguard makes (agreement/control_group.py), or none for a process alone. Again after a
        rebuild: the new formation's group."""
        import torch.distributed as dist

        from spotguard.hooks.agreement.collectives import Collectives, GroupCollectives
        from spotguard.hooks.agreement.control_group import control_groups

        self._group = None
        if dist.is_available() and dist.is_initialized():
            groups = control_groups()
            self._group = groups.checkpoint if groups is not None else None
        self._collectives: Vote = GroupCollectives(self._group) if self._group is not None else Collectives()
        self.rank, self.world_size = self._collectives.rank, self._collectives.world_size
        self._commit = CollectiveCommit(self.store, self._collectives)

    # ---- subclass hooks --------------------------------------------------------------------
    def _state(self, step: int) -> Any:
        """The live state to copy at `step`."""
        raise NotImplementedError

    def _write_state(self, pending: PendingCheckpoint, state: Any) -> None:
        """This rank's files of `state`, a tree over the engine's buffers."""
        raise NotImplementedError

    def _write_state_over(self, pending: PendingCheckpoint, state: Any, channel: StoreChannel) -> None:
        """`_write_state` with its coordination through `channel`, no group (`writes_over_channel`)."""
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
    def _copy(self, step: int) -> Snapshot:
        """The snapshot of `step` (the stall); it becomes the held snapshot."""
        engine = self.snapshot_engine
        extra = self.extra_state_now()
        engine.wait()  # a persist in flight still reads the held snapshot: it stays held until then
        self._snapshot, self.snapshot_step = None, None  # the buffers are about to change
        snap = engine.snapshot(lambda: self._state(step), step=step, extra=extra)
        self._snapshot, self.snapshot_step = snap, step
        self.prepared = True  # the buffers fit the current state now
        return snap

    def _persist(self, snap: Snapshot | None, step: int, reason: str, notice: Notice | None, *,
                 snapshot: bool, failure: BaseException | None = None, channel: StoreChannel | None = None) -> Future:
        """The engine's background persist of `snap` through the commit protocol (a Future of the
        CheckpointInfo on rank 0, None elsewhere). With `failure` (this rank could not take the
        snapshot) every rank still runs the protocol, so all of them learn that this checkpoint failed.
        With `channel` the ranks coordinate through it (the write and the commit), not the group:
        everything the write needs of the group is bound now, so it may outlive the group."""
        extra = snap.extra if snap is not None else {}
        world_size, rank, extra_metadata = self.world_size, self.rank, self._metadata_extra()
        if channel is not None:  # a persist in flight runs on the group the caller is about to leave
            self.snapshot_engine.wait()
        protocol = self._commit if channel is None else CollectiveCommit(self.store, channel)

        def write(pending: PendingCheckpoint) -> None:
            try:
                if failure is not None or snap is None:
                    raise CheckpointFailed(f"rank {rank}: no snapshot of step {step}") from failure
                if channel is None:
                    self._write_state(pending, snap.state)
                else:
                    self._write_state_over(pending, snap.state, channel)
            except BaseException as exc:  # the peers wait in the write's rounds: they learn it now
                if channel is not None:
                    channel.abort(f"its part of step {step} failed: {type(exc).__name__}: {exc}")
                raise

        def metadata() -> dict[str, Any]:
            return {"step": step, "reason": reason, "notice_id": notice.id if notice else None,
                    "world_size": world_size, "snapshot": snapshot, "extra": extra, **extra_metadata}

        def commit(_state: Any = None) -> CheckpointInfo | None:
            try:
                info = protocol.run(self._tag(step, reason), write, metadata, after_commit=self._after_commit)
            finally:
                if channel is not None:  # its last round read: the store's host may go
                    channel.close()
            self.last_info = info
            return info

        if snap is None:
            return self.snapshot_engine.submit(commit)
        return self.snapshot_engine.persist(snap, commit)

    def _fresh(self, step: int, reason: str, notice: Notice | None, channel: StoreChannel | None = None) -> Future:
        """Snapshot now, persist in the background: the Future of the commit."""
        self.wait()
        try:
            snap: Snapshot | None = self._copy(step)
            failure = None
        except BaseException as exc:
            reraise_interrupts(exc)
            log.exception("rank %d could not copy the state of step %d", self.rank, step)
            snap, failure = None, exc
        return self._persist(snap, step, reason, notice, snapshot=False, failure=failure, channel=channel)

    def prepare(self) -> None:
        """Allocates the snapshot buffers now (a copy of the current state, not a checkpoint), on
        every rank at the same step (DeepSpeed's copy is collective); nothing when `prepared`.
        The Guard calls it at its first step boundary (and the first after an in-place change)."""
        if self.prepared:
            return
        engine = self.snapshot_engine
        self.wait()
        engine.snapshot(lambda: self._state(-1), step=-1, timed=False)
        engine.forget()
        self._snapshot, self.snapshot_step = None, None
        self.prepared = True

    def save_parts(self) -> PartTimes:
        """Measured seconds of each part of a save (snapshot, persist); None where not measured."""
        return self.snapshot_engine.estimate()

    # ---- the CheckpointAdapter interface ----------------------------------------------------
    def save(self, step: int, *, reason: str = "periodic", notice: Notice | None = None) -> CheckpointInfo | None:
        t0 = time.monotonic()
        info = self._fresh(step, reason, notice).result()
        self.save_seconds.append(time.monotonic() - t0)
        return info

    def save_behind(self, step: int, *, reason: str = "periodic", notice: Notice | None = None,
                    channel: StoreChannel | None = None) -> Future:
        """Collective: `save`, but returns once the state is copied (the stall); the Future is done
        when the commit is (its result the CheckpointInfo; CheckpointFailed on every rank when any
        rank failed). With `channel` (an adapter whose `writes_over_channel`) the write and its
        commit coordinate through it and may outlive the current group."""
        t0 = time.monotonic()
        future = self._fresh(step, reason, notice, channel)

        def timed(finished: Future) -> None:
            if finished.exception() is None:
                self.save_seconds.append(time.monotonic() - t0)

        future.add_done_callback(timed)
        return future

    def persist_snapshot_behind(self, *, reason: str = "notice", notice: Notice | None = None,
                                channel: StoreChannel | None = None) -> tuple[int, Future]:
        """`persist_snapshot`, returning at once: (the held snapshot's step, the Future of its commit);
        `channel` as in `save_behind`."""
        snap = self._snapshot
        if self.snapshot_step is None or snap is None or not snap.valid:
            raise CheckpointFailed("no snapshot to persist")
        return snap.step, self._persist(snap, snap.step, reason, notice, snapshot=True, channel=channel)

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
        self.snapshot_engine.wait(timeout)

    def snapshot(self, step: int) -> None:
        self._copy(step)

    def persist_snapshot(self, *, reason: str = "notice", notice: Notice | None = None) -> int:
        snap = self._snapshot
        if self.snapshot_step is None or snap is None or not snap.valid:
            raise CheckpointFailed("no snapshot to persist")
        self._persist(snap, snap.step, reason, notice, snapshot=True).result()
        return snap.step

    def snapshot_durable(self) -> bool:
        """Whether the held snapshot was persisted already (a `save_async` of its step committed)."""
        snap = self._snapshot
        return snap is not None and snap.valid and self.snapshot_engine.persisted_generation == snap.generation

    @property
    def held_snapshot(self) -> Any:
        """The last snapshot's state, a tree over the engine's buffers (None before the first)."""
        snap = self._snapshot
        return snap.state if snap is not None and snap.valid else None

    def answered_notice_id(self) -> str | None:
        return (self.resumed_metadata or {}).get("notice_id") or None

    def extra_state_now(self) -> dict[str, Any]:
        extra = dict(self.extra_state()) if self.extra_state else {}
        if self.data is not None:
            extra[DATA_KEY] = self.data.state_dict()
        return extra

    @property
    def extra(self) -> dict[str, Any]:
        """The user's extras a resume or a live peer handed over (without the data position)."""
        return self._extra

    @extra.setter
    def extra(self, handed_over: dict[str, Any]) -> None:
        extra = dict(handed_over)
        position = extra.pop(DATA_KEY, None)
        if self.data is not None:
            if position is None:
                log.warning("the state handed over holds no data position (saved without data=?): the sampler "
                            "keeps its own, and a loop that checks it will refuse to start")
            else:
                self.data.load_state_dict(position)
        self._extra = extra

    def gradient_carrier(self) -> Any:
        return None

    def close(self) -> None:
        self.snapshot_engine.close()
        self.prepared = False  # the buffers are freed

    def estimate_save_seconds(self) -> float | None:
        fresh = self.save_parts().fresh
        if fresh is not None:
            return 1.25 * fresh
        return 1.25 * max(self.save_seconds) if self.save_seconds else None

    def resume(self) -> int | None:
        info = self.store.resolve(verify=True)
        if info is None:
            return None
        self._collectives.all_ok(True)  # every rank sees the same newest checkpoint before anyone loads
        self._load(info)
        self.resumed_metadata = dict(info.metadata)
        self.extra = dict(info.metadata.get("extra") or {})
        log.info("resumed from checkpoint %s (step %s, saved by %s ranks)", info.tag, info.step, info.world_size)
        return int(info.metadata["step"]) + 1
