"""The fast checkpoint path: snapshot into preallocated host buffers, persist in the background.

    fast = FastCheckpointer(files=4)          # once, at start
    fast.prepare(state)                       # plans the arena, checks host memory, allocates
    ...                                       # and touches the buffers (no allocation later)
    snap = fast.snapshot(state, step=120)     # at a step boundary: memcpy only (the stall)
    done = fast.persist(snap, store.begin(tag), rank)   # background: files in parallel, fsync
    done.result(); barrier(); rank 0: store.commit(tag, world_size, metadata)

`maybe_snapshot(state, step)` takes a snapshot every `every` steps; `latest_snapshot` is what
the Guard's deadline fallback persists when a fresh save cannot fit before the deadline.

Contracts:
- The arena is one contiguous byte buffer per slot, sized from the state at `prepare`, each
  tensor at an aligned offset; a snapshot copies every tensor into its place and captures the
  non-tensor skeleton. If the state's tensors change (names, dtypes or shapes - e.g. optimizer
  state appears after the first step), the next snapshot re-plans and re-allocates, with a
  warning; call `prepare` after the first step to keep that off the notice path.
- `persist` writes `<prefix>-rank<r>.json` (rawformat index) and its data files into the
  pending dir from `files` parallel writers, each computing CRC-32 and fsyncing, then calls
  `pending.finish_rank(rank)`. A slot being persisted is not overwritten: with `slots=1` a
  snapshot waits for that persist; with `slots=2` it uses the other slot.
- mode="thread" (default) persists from a thread pool in this process; mode="process" puts the
  arena in shared memory (/dev/shm) and a separate writer process does the I/O. On this
  2-core VM bench/checkpoint_speed.py (1 GB, median of 3) gave durable 1.46 s for process
  writers vs 1.71 s for threads, stalls 0.078 s vs 0.067 s; the disk's variance is of the same
  order. Threads stay the default because a pod's /dev/shm is 64 MiB unless a memory-backed
  emptyDir is mounted there; choose "process" where it is.
"""
from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from collections.abc import Mapping
from typing import IO, Any, cast

import torch

from spotguard.config import ConfigError, one_of, positive_int

from . import rawformat
from .layout import flatten, signature
from .memory import check_host_memory
from .store import CheckpointInfo, CheckpointStore, PendingCheckpoint

log = logging.getLogger(__name__)


def index_name(prefix: str, rank: int) -> str:
    return f"{prefix}-rank{rank}.json"


@dataclass
class Snapshot:
    """A consistent copy of the state in one arena slot, taken at `step`."""

    slot: _Slot
    step: int | None
    skeleton: Any
    metadata: dict[str, Any]
    taken_at: float
    stall_seconds: float
    generation: int

    @property
    def valid(self) -> bool:
        """False once a newer snapshot reused this slot."""
        return self.slot.generation == self.generation


@dataclass
class _Slot:
    arena: torch.Tensor
    views: list[torch.Tensor]
    shm: shared_memory.SharedMemory | None = None
    generation: int = 0
    persisting: Future | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class FastCheckpointer:
    """Preallocated snapshot buffers plus background, parallel, fsync'd persistence."""

    def __init__(self, *, files: int = 4, slots: int = 1, every: int = 0, mode: str = "thread",
                 prefix: str = "fast", check_memory: bool = True):
        self.files = positive_int("files", files)
        self.slot_count = positive_int("slots", slots)
        self.every = positive_int("every", every, allow_zero=True)
        self.mode = one_of("mode", mode, ("thread", "process"))
        if not prefix or "/" in prefix:
            raise ConfigError("prefix", f"must be a plain file-name prefix, got {prefix!r}")
        self.prefix = prefix
        self.check_memory = check_memory
        self._signature: tuple | None = None
        self._plan: list[rawformat.TensorSlot] = []
        self._total = 0
        self._bounds: list[tuple[int, int]] = []
        self._slots: list[_Slot] = []
        self._latest: Snapshot | None = None
        self._generation = 0
        self._mutex = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._coordinator = ThreadPoolExecutor(1, thread_name_prefix="spotguard-persist")
        self._process: _WriterProcess | None = None

    # ---- setup --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot (one slot)."""
        return self._total

    def prepare(self, state: Any) -> None:
        """Plans the arena for `state`, checks host memory, allocates and touches every slot.

        Raises InsufficientHostMemory (a ConfigError) when the slots would not fit.
        """
        _, tensors = flatten(state)
        self._allocate(tensors)

    def _allocate(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        plan, total = rawformat.plan_offsets(tensors)
        if self.check_memory:
            check_host_memory(total * self.slot_count, what=f"{self.slot_count} snapshot slot(s) of the training state")
        self._release_slots()
        self._plan, self._total = plan, total
        self._bounds = rawformat.plan_files(total, self.files)
        for _ in range(self.slot_count):
            shm = None
            if self.mode == "process":
                shm = shared_memory.SharedMemory(create=True, size=max(total, 1))
                arena = torch.frombuffer(shm.buf, dtype=torch.uint8)
            else:
                arena = torch.empty(max(total, 1), dtype=torch.uint8)
            arena.zero_()  # fault every page in now, not during the snapshot
            views = [arena[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) if s.nbytes
                     else torch.empty(s.shape, dtype=s.dtype) for s in plan]
            self._slots.append(_Slot(arena=arena, views=views, shm=shm))
        self._signature = signature(tensors)
        if self.mode == "thread" and self._pool is None:
            self._pool = ThreadPoolExecutor(self.files, thread_name_prefix="spotguard-write")
        if self.mode == "process" and self._process is None:
            self._process = _WriterProcess(self.files)
        log.info("fast checkpoint path ready: %d slot(s) of %.1f MB, %d file(s), %s mode",
                 self.slot_count, total / 1e6, len(self._bounds), self.mode)

    # ---- snapshot -----------------------------------------------------------------------------
    def _free_slot(self) -> _Slot:
        candidates = sorted(self._slots, key=lambda s: s.generation)
        for slot in candidates:
            if slot.persisting is None or slot.persisting.done():
                return slot
        oldest = candidates[0]
        if oldest.persisting is not None:  # always: a slot without one was returned above
            log.warning("every snapshot slot is being persisted; waiting for the oldest")
            oldest.persisting.exception()  # wait; errors were logged by the persist itself
        return oldest

    def snapshot(self, state: Any, *, step: int | None = None, metadata: Mapping[str, Any] | None = None) -> Snapshot:
        """Copies `state`'s tensors into a free slot; the only part that stalls training."""
        started = time.perf_counter()
        skeleton, tensors = flatten(state)
        if signature(tensors) != self._signature:
            if self._signature is not None:
                log.warning("training state layout changed since prepare(); re-allocating snapshot buffers")
            self._allocate(tensors)
        with self._mutex:
            slot = self._free_slot()
            with slot.lock:
                for view, (_, tensor) in zip(slot.views, tensors):
                    view.copy_(tensor, non_blocking=False)
                self._generation += 1
                slot.generation = self._generation
            snap = Snapshot(slot=slot, step=step, skeleton=skeleton, metadata=dict(metadata or {}),
                            taken_at=time.time(), stall_seconds=time.perf_counter() - started,
                            generation=self._generation)
            self._latest = snap
        return snap

    def maybe_snapshot(self, state: Any, step: int, metadata: Mapping[str, Any] | None = None) -> Snapshot | None:
        """Takes a snapshot when periodic snapshots are on (`every` > 0) and `step` is a multiple of it."""
        if self.every and step % self.every == 0:
            return self.snapshot(state, step=step, metadata=metadata)
        return None

    @property
    def latest_snapshot(self) -> Snapshot | None:
        """The newest snapshot still intact in memory (for the deadline fallback), or None."""
        snap = self._latest
        return snap if snap is not None and snap.valid else None

    # ---- persist ------------------------------------------------------------------------------
    def persist(self, snap: Snapshot, pending: PendingCheckpoint, rank: int = 0) -> Future:
        """Writes `snap` into `pending` in the background; the future's result is the bytes written.

        On success this rank's part manifest is written (`finish_rank`); on failure the future
        holds the exception and nothing is marked finished.
        """
        if not snap.valid:
            raise ValueError("snapshot was overwritten by a newer one; persist the newer snapshot")
        slot = snap.slot
        future = self._coordinator.submit(self._persist_now, snap, pending, rank)
        slot.persisting = future
        return future

    def _persist_now(self, snap: Snapshot, pending: PendingCheckpoint, rank: int) -> int:
        started = time.perf_counter()
        index_rel = index_name(self.prefix, rank)
        names = [rawformat.data_name(index_rel, k) for k in range(len(self._bounds))]
        paths = [pending.path(n) for n in names]
        with snap.slot.lock:
            if not snap.valid:
                raise RuntimeError("snapshot was overwritten before it was persisted")
            jobs = [(p, a, b) for p, (a, b) in zip(paths, self._bounds)]
            write = self._write_process if self.mode == "process" else self._write_threads
            results = write(snap.slot, jobs)
        for name, (size, crc) in zip(names, results):
            pending.record(name, size, crc)
        meta = {"step": snap.step, "rank": rank, "taken_at": snap.taken_at, **snap.metadata}
        index = rawformat.build_index(snap.skeleton, self._plan, self._total,
                                      [(n, s, c) for n, (s, c) in zip(names, results)], meta)
        pending.write_bytes(index_rel, index)
        pending.finish_rank(rank)
        log.info("rank %d persisted %.1f MB in %.2fs", rank, self._total / 1e6, time.perf_counter() - started)
        return self._total

    def _write_process(self, slot: _Slot, jobs: list[tuple[Path, int, int]]) -> list[tuple[int, int]]:
        """Writes each (path, start, end) range of the slot's shared memory in the writer process."""
        if self._process is None or slot.shm is None:
            raise RuntimeError("FastCheckpointer: no writer process or shared memory "
                               "(prepare() first, not after close())")
        return self._process.write(slot.shm.name, [(str(p), a, b) for p, a, b in jobs])

    def _write_threads(self, slot: _Slot, jobs: list[tuple[Path, int, int]]) -> list[tuple[int, int]]:
        """Writes each (path, start, end) range of the slot's arena on the file-writer threads."""
        if self._pool is None:
            raise RuntimeError("FastCheckpointer: no writer threads (prepare() first, not after close())")
        view = slot.arena.numpy().data
        futures = [self._pool.submit(rawformat.write_pieces, p, [view[a:b]]) for p, a, b in jobs]
        return [f.result() for f in futures]

    def save(self, store: CheckpointStore, tag: str, state: Any, *, step: int | None = None, rank: int = 0,
             world_size: int = 1, metadata: Mapping[str, Any] | None = None) -> tuple[Snapshot, Future]:
        """Snapshot + persist; for world_size 1 the future also commits and yields CheckpointInfo.

        For world_size > 1 the future yields the byte count; the caller barriers and rank 0
        commits. Returns (snapshot, future); the call itself stalls only for the snapshot.
        """
        meta = dict(metadata or {})
        if step is not None:
            meta.setdefault("step", step)
        snap = self.snapshot(state, step=step, metadata=meta)
        pending = store.begin(tag)
        written = self.persist(snap, pending, rank)
        if world_size != 1:
            return snap, written
        committed: Future = Future()

        def finish(done: Future) -> None:
            try:
                done.result()
                committed.set_result(store.commit(tag, world_size=1, metadata=meta))
            except BaseException as exc:  # handed to the caller through the future
                pending.close()
                committed.set_exception(exc)

        written.add_done_callback(finish)
        return snap, committed

    # ---- teardown -----------------------------------------------------------------------------
    def _release_slots(self) -> None:
        for slot in self._slots:
            if slot.persisting is not None:
                slot.persisting.exception()
            shm = slot.shm
            slot.views.clear()
            slot.arena = None  # type: ignore[assignment]
            if shm is not None:
                try:
                    shm.close()
                except BufferError:
                    log.warning("snapshot buffer still referenced; leaving it to process exit")
                shm.unlink()
        self._slots.clear()
        self._latest = None

    def close(self) -> None:
        """Waits for in-flight persists, frees buffers, stops workers. Idempotent."""
        self._coordinator.shutdown(wait=True)
        self._release_slots()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._process is not None:
            self._process.close()
            self._process = None

    def __enter__(self) -> FastCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_rank(checkpoint: CheckpointInfo | Path | str, rank: int = 0, *, prefix: str = "fast",
              verify: bool = False) -> tuple[Any, dict[str, Any]]:
    """(state, meta) that rank `rank` persisted into a committed checkpoint (or directory)."""
    directory = checkpoint.dir if isinstance(checkpoint, CheckpointInfo) else Path(checkpoint)
    return rawformat.load_blob(directory / index_name(prefix, rank), verify=verify)


# ---- writer process (mode="process") ------------------------------------------------------------
class _WriterProcess:
    """A long-lived child process (started at prepare time) that writes shared-memory ranges."""

    def __init__(self, threads: int):
        self._proc = subprocess.Popen([sys.executable, "-m", "spotguard.hooks.checkpoint.writerproc", str(threads)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        # stdin and stdout are PIPEs, so Popen set both
        self._stdin, self._stdout = cast(IO[str], self._proc.stdin), cast(IO[str], self._proc.stdout)
        self._mutex = threading.Lock()
        ready = self._stdout.readline()  # at prepare time, so no save waits for its start-up
        if not ready.startswith('{"ready"'):
            self.close()
            raise OSError(f"checkpoint writer process failed to start: {ready!r}")

    def write(self, shm_name: str, jobs: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
        with self._mutex:
            if self._proc.poll() is not None:
                raise OSError(f"checkpoint writer process exited with {self._proc.returncode}")
            self._stdin.write(json.dumps({"shm": shm_name, "jobs": jobs}) + "\n")
            self._stdin.flush()
            line = self._stdout.readline()
        if not line:
            raise OSError("checkpoint writer process died during a write")
        answer = json.loads(line)
        if "ok" not in answer:
            raise OSError(f"checkpoint writer process: {answer.get('error')}")
        return [tuple(x) for x in answer["ok"]]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        with contextlib.suppress(OSError, ValueError):
            self._stdout.close()
