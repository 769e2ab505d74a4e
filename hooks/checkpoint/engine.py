"""The one snapshot-and-persist engine every adapter's save runs through.

    engine = SnapshotEngine()                                   # once, per adapter
    snap = engine.snapshot(state, step=120, extra={...})        # at the step boundary: the stall
    done = engine.persist(snap, write)                          # background: write(snap.state)
    done.result()                                               # durable: whatever write committed
    engine.estimate()                                           # PartTimes(snapshot=, persist=)

Contract:
- `snapshot` copies `state`'s tensors into `SnapshotBuffers` (buffers.py: allocated at the first
  snapshot, pinned and filled on a side stream when the tensors are on a GPU) and returns a
  `Snapshot` whose `state` is the same tree over the buffers. That copy is the only time the
  training loop is held. There is one set of buffers: a snapshot first waits for a persist in
  flight, which is still reading them, and makes every earlier `Snapshot` invalid.
- `persist(snap, write)` runs `write(snap.state)` on the engine's writer thread (one at a time,
  in call order) and returns its Future. The adapter's `write` is the store's complete-or-
  invisible commit (begin -> its files -> finish_rank -> every rank agrees -> rank 0 commits),
  so a persist is durable exactly when its future is done.
- Each part's duration is kept (the last 5 of each, successful runs only); `estimate()` is the
  slowest recent one of each, so the deadline logic can price a fresh save (snapshot + persist)
  and the persist of a held snapshot (persist) apart.
- `in_flight()`: the Future of the persist running or queued now (None when idle);
  `persisted_generation` / `persisted_step`: the generation and step of the newest snapshot
  whose persist succeeded (a snapshot with that generation is durable already).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .buffers import SnapshotBuffers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartTimes:
    """Seconds of each part of a save: the copy at the step boundary, and the persist to durable."""

    snapshot: float | None
    persist: float | None

    @property
    def fresh(self) -> float | None:
        """A fresh save: both parts (None until each was measured once)."""
        if self.snapshot is None or self.persist is None:
            return None
        return self.snapshot + self.persist


@dataclass
class Snapshot:
    """A copy of the state taken at `step` (its tensors live in the engine's buffers)."""

    state: Any
    step: int
    extra: dict[str, Any]
    taken_at: float
    seconds: float
    generation: int
    engine: SnapshotEngine = field(repr=False)

    @property
    def valid(self) -> bool:
        """False once a newer snapshot reused the buffers."""
        return self.engine.generation == self.generation


class SnapshotEngine:
    """Snapshot into buffers allocated once; persist in the background; see the module docstring."""

    def __init__(self, *, check_memory: bool = True, history: int = 5):
        self.buffers = SnapshotBuffers(check_memory=check_memory)
        self.generation = 0
        self.snapshot_seconds: deque[float] = deque(maxlen=history)
        self.persist_seconds: deque[float] = deque(maxlen=history)
        self._writer: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self.persisted_generation = -1
        self.persisted_step: int | None = None
        self._mutex = threading.Lock()

    def snapshot(self, state: Any, *, step: int, extra: dict[str, Any] | None = None,
                 timed: bool = True) -> Snapshot:
        """Copies `state` into the buffers (waits first for a persist in flight); the stall.

        `state` may be a callable returning the state: its call is then part of the stall
        measured (a framework's capture of its state holds the loop too). `timed=False` keeps
        this copy out of the measured snapshot times (a copy that allocated the buffers)."""
        self.wait()
        started = time.perf_counter()
        with self._mutex:
            copied = self.buffers.copy_in(state() if callable(state) else state)
            self.generation += 1
            seconds = time.perf_counter() - started
            if timed:
                self.snapshot_seconds.append(seconds)
            return Snapshot(copied, step, dict(extra or {}), time.time(), seconds, self.generation, self)

    def persist(self, snap: Snapshot, write: Callable[[Any], Any]) -> Future:
        """Runs `write(snap.state)` on the writer thread; the future holds its result or exception."""
        if not snap.valid:
            raise ValueError(f"the snapshot of step {snap.step} was overwritten by a newer one")

        def run() -> Any:
            started = time.perf_counter()
            self.buffers.ready()
            result = write(snap.state)
            self.persist_seconds.append(time.perf_counter() - started)
            self.persisted_generation, self.persisted_step = snap.generation, snap.step
            return result

        return self.submit(run)

    def submit(self, job: Callable[[], Any]) -> Future:
        """Runs `job()` on the writer thread after the persists queued before it (its Future)."""
        with self._mutex:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="spotguard-persist")
            future = self._writer.submit(job)
            self._inflight = future
        return future

    def in_flight(self) -> Future | None:
        """The persist running or queued now, or None."""
        future = self._inflight
        return future if future is not None and not future.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Returns once no persist is in flight (its outcome is its caller's to read)."""
        future = self._inflight
        if future is not None:
            future.exception(timeout)

    def estimate(self) -> PartTimes:
        """The slowest recent duration of each part (None for a part never measured)."""
        return PartTimes(max(self.snapshot_seconds) if self.snapshot_seconds else None,
                         max(self.persist_seconds) if self.persist_seconds else None)

    def forget(self) -> None:
        """Invalidates every snapshot taken so far (the state they copied is gone, e.g. after a resize)."""
        self.wait()
        with self._mutex:
            self.generation += 1

    def close(self) -> None:
        """Waits for the persist in flight, stops the writer thread and frees the buffers (a later
        snapshot or persist starts them again)."""
        self.wait()
        with self._mutex:
            writer, self._writer = self._writer, None
            self.generation += 1
        if writer is not None:
            writer.shutdown(wait=True)
        self.buffers.release()
