"""The `CheckpointAdapter` protocol the Guard drives, and `StoreAdapter`, what every adapter shares:
the store, the commit protocol across ranks, save timing, snapshots.

An adapter is made on its own (`checkpoint_dir=` or `store=`) and handed to the Guard
(`Guard.from_env(adapter=...)` or `guard.attach(adapter)`); it never needs the Guard.

Contract for subclasses: implement `_write(pending, step)` (this rank's files for a fresh save),
`_take_snapshot(step)` (an in-memory copy), `_write_snapshot(pending, snapshot)` and
`_load(info)` (returns nothing; restores the state). The base class then gives the Guard's
`CheckpointAdapter` interface:
- `save(step, reason=..., notice=...)`: collective; begins `step-<step>-<reason>` in the store,
  writes, `finish_rank`, agrees that every rank finished, rank 0 commits with metadata
  {step, reason, notice_id, world_size, extra}, every rank learns the outcome; raises
  `CheckpointFailed` on every rank when any rank failed (so no rank waits forever for a commit).
- `snapshot(step)` / `persist_snapshot(...)`: the same commit for the last snapshot.
- `estimate_save_seconds()`: 1.25 x the slowest of the last 5 measured fresh saves.
- `resume()`: the newest complete, verified checkpoint -> `_load`, `resumed_metadata`,
  `extra` (the dict `extra_state()` returned at save time); returns `step + 1`.
- `answered_notice_id()`: the notice the resumed checkpoint was saved for; `gradient_carrier()`:
  None (an adapter of a DDP model returns the model); `held_snapshot`: the last snapshot.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Protocol, runtime_checkable
from collections.abc import Callable

from spotguard.hooks.adapters.store import CheckpointInfo, CheckpointStore
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


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be made durable (some rank failed to write, or the commit failed)."""


def reraise_interrupts(exc: BaseException) -> None:
    """Re-raises what must not be swallowed (SystemExit, KeyboardInterrupt)."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        raise exc


def tag_for(step: int, reason: str) -> str:
    return f"step-{step:09d}-{reason}"


class StoreAdapter:
    """Base of the framework adapters; see the module docstring."""

    def __init__(self, *, checkpoint_dir: str | os.PathLike | None = None, store: CheckpointStore | None = None,
                 keep_last: int = 3, extra_state: Callable[[], dict[str, Any]] | None = None):
        if store is None:
            if checkpoint_dir is None:
                raise ValueError("an adapter needs checkpoint_dir or a store")
            store = CheckpointStore(checkpoint_dir, keep_last=keep_last)
        self.store = store
        self.extra_state = extra_state
        self.extra: dict[str, Any] = {}
        self.resumed_metadata: dict[str, Any] | None = None
        self.snapshot_step: int | None = None
        self._snapshot: Any = None
        self._snapshot_extra: dict[str, Any] = {}
        self.save_seconds: deque[float] = deque(maxlen=5)
        self.last_info: CheckpointInfo | None = None
        self._setup_group()

    # ---- collectives: the adapter's own gloo group (created in the same order on every rank) --
    def _setup_group(self) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self._group = 0, 1, None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size > 1:
                self._group = dist.new_group(backend="gloo")

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

    # ---- subclass hooks --------------------------------------------------------------------
    def _write(self, pending, step: int) -> None:
        raise NotImplementedError

    def _take_snapshot(self, step: int) -> Any:
        raise NotImplementedError

    def _write_snapshot(self, pending, snapshot: Any) -> None:
        raise NotImplementedError

    def _load(self, info: CheckpointInfo) -> None:
        raise NotImplementedError

    def _metadata_extra(self) -> dict[str, Any]:
        return {}

    # ---- the CheckpointAdapter interface ----------------------------------------------------
    def save(self, step: int, *, reason: str = "periodic", notice: Notice | None = None) -> CheckpointInfo | None:
        t0 = time.monotonic()
        extra = self.extra_state() if self.extra_state else {}
        info = self._checkpoint(step, reason, notice, extra, lambda pending: self._write(pending, step))
        self.save_seconds.append(time.monotonic() - t0)
        return info

    def snapshot(self, step: int) -> None:
        self._snapshot = self._take_snapshot(step)
        self._snapshot_extra = self.extra_state() if self.extra_state else {}
        self.snapshot_step = step

    def persist_snapshot(self, *, reason: str = "notice", notice: Notice | None = None) -> int:
        if self.snapshot_step is None:
            raise CheckpointFailed("no snapshot to persist")
        step, snapshot = self.snapshot_step, self._snapshot
        self._checkpoint(step, reason, notice, self._snapshot_extra,
                         lambda pending: self._write_snapshot(pending, snapshot), snapshot=True)
        return step

    @property
    def held_snapshot(self) -> Any:
        """The last snapshot, as `_take_snapshot` returned it (None before the first)."""
        return self._snapshot

    def answered_notice_id(self) -> str | None:
        return (self.resumed_metadata or {}).get("notice_id") or None

    def extra_state_now(self) -> dict[str, Any]:
        return self.extra_state() if self.extra_state else {}

    def gradient_carrier(self) -> Any:
        return None

    def close(self) -> None:
        pass

    def estimate_save_seconds(self) -> float | None:
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
        tag = tag_for(step, reason)
        ok = True
        try:
            if pending is None:
                pending = self.store.begin(tag)
            write(pending)
            pending.finish_rank(self.rank)
        except BaseException as exc:  # every rank must learn about the failure
            reraise_interrupts(exc)  # (DCP's CheckpointException derives from BaseException)
            log.exception("rank %d could not write its part of checkpoint %s", self.rank, tag)
            ok = False
        if not self._all_ok(ok):
            raise CheckpointFailed(f"checkpoint {tag}: a rank failed to write its part")
        info, ok = None, True
        if self.rank == 0:
            metadata = {"step": step, "reason": reason, "notice_id": notice.id if notice else None,
                        "world_size": self.world_size, "snapshot": snapshot, "extra": extra,
                        **self._metadata_extra()}
            try:
                info = self.store.commit(tag, world_size=self.world_size, metadata=metadata)
            except BaseException as exc:
                reraise_interrupts(exc)
                log.exception("commit of checkpoint %s failed", tag)
                ok = False
        if not self._all_ok(ok):
            raise CheckpointFailed(f"checkpoint {tag}: commit failed")
        self.last_info = info
        return info
