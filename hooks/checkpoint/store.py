"""The checkpoint store: a checkpoint is either complete and verifiable, or invisible.

Layout under `root` (a local path or a mounted PVC):
- `.pending-<tag>/`: where every rank writes its files for `<tag>`; each rank ends with a part
  manifest `.spotguard-part-<rank>.json` (its files, sizes, CRC-32s), fsynced;
- `<tag>/`: a committed checkpoint, created only by renaming a pending directory after
  `spotguard-manifest.json` (all files, sizes, checksums, metadata, a commit sequence number)
  was written and fsynced inside it;
- `latest`: a text file holding the newest committed tag (the DeepSpeed convention), replaced
  atomically after the rename; readers treat it as a hint, the manifests are the truth;
- `.locks/`, `.store.lock`: writer liveness (see locks.py); `.trash-*`: directories being deleted;
  `.replaced-<tag>-<id>`: the previous copy of a re-committed tag, deleted once the new one is
  in place and named by `latest`;
- `_<kind>/`: copies derived from checkpoints (derived.py), pruned with them.

Ordering of a commit: part manifests checked -> manifest written + fsynced -> an existing `<tag>`
renamed aside -> pending dir renamed to `<tag>` -> root fsynced -> `latest` replaced -> the
set-aside copy deleted -> retention. A crash at any point leaves either the previous set of
complete checkpoints or that set plus the new one: the next open's `cleanup` makes the newest
complete copy of every tag `<tag>/` again (recovery.py) before it deletes any leftover, and
points `latest` at the newest checkpoint.

Backends: `open_store(location)` opens this store for a directory and, for `s3://bucket/prefix`,
`objectstore.store.ObjectCheckpointStore` (this store as the local first tier, the object store as
the tier that survives the node; same interface).
"""
from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from spotguard.config import ConfigError, positive_int

from . import fsutil
from .derived import DerivedCopies, derived_areas
from .locks import WriterLock, live_tags_reaping_dead, store_lock
from .manifest import (LATEST, MANIFEST, MANIFEST_VERSION, PART_PREFIX, PENDING_PREFIX, REPLACED_PREFIX, TAG_RE,
                       TRASH_PREFIX, aside_name, collect_parts, fingerprint, read_manifest)
from .recovery import recover_commits, repair_latest

log = logging.getLogger(__name__)

__all__ = ["MANIFEST", "CheckpointCorrupt", "CheckpointInfo", "CheckpointStore", "CommitError", "PendingCheckpoint",
           "open_store", "validate_tag"]


class CheckpointCorrupt(Exception):
    """A committed checkpoint failed verification (missing file, wrong size or checksum)."""

    def __init__(self, tag: str, problems: list[str]):
        super().__init__(f"checkpoint {tag!r} is damaged: " + "; ".join(problems[:5])
                         + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
        self.tag = tag
        self.problems = problems


class CommitError(Exception):
    """A commit was refused (a rank's part is missing or inconsistent); nothing became visible."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    tag: str
    dir: Path
    sequence: int
    world_size: int
    metadata: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(repr=False)
    committed_at: float = 0.0
    fingerprint: str = field(default="", repr=False)  # SHA-256 of the manifest: this very commit

    @property
    def step(self) -> int | None:
        step = self.metadata.get("step")
        return int(step) if isinstance(step, (int, float)) else None

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def validate_tag(tag: str) -> str:
    """Returns `tag` if it is a safe directory name (letters, digits, `_ . -`), else ValueError."""
    if not isinstance(tag, str) or not TAG_RE.match(tag) or tag in (LATEST, MANIFEST):
        raise ValueError(f"invalid checkpoint tag {tag!r}: use letters, digits, '_', '.', '-' "
                         "(not starting with '.' or '-')")
    return tag


def _validate_relpath(relpath: str | os.PathLike) -> str:
    rel = Path(relpath)
    if rel.is_absolute() or not rel.parts or any(p in ("", ".", "..") for p in rel.parts):
        raise ValueError(f"invalid file name in a checkpoint: {str(relpath)!r}")
    if rel.name == MANIFEST or rel.name.startswith(PART_PREFIX):
        raise ValueError(f"{str(relpath)!r} is reserved by the checkpoint store")
    return rel.as_posix()


class PendingCheckpoint:
    """One rank's view of `.pending-<tag>/` between `store.begin()` and the commit.

    Files reach the part manifest by being written through `write_bytes`/`open_file`, or by
    `record` (written and fsynced elsewhere, checksum known) or `adopt` (written elsewhere:
    read back, checksummed, fsynced). The writer lock is held until `close()` (or `commit`
    in this process), so cleanup by other processes leaves the directory alone meanwhile.
    """

    def __init__(self, store: CheckpointStore, tag: str, lock: WriterLock):
        self.store = store
        self.tag = tag
        self.dir = store.root / f"{PENDING_PREFIX}{tag}"
        self._lock = lock
        self._files: dict[str, dict[str, Any]] = {}
        self._dirs_touched: set[Path] = {self.dir}
        self._mutex = threading.Lock()
        self.finished_ranks: set[int] = set()

    def path(self, relpath: str | os.PathLike) -> Path:
        """Absolute path for `relpath` inside the pending directory (parents created)."""
        rel = _validate_relpath(relpath)
        target = self.dir / rel
        if target.parent != self.dir:
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._mutex:
                probe = target.parent
                while probe != self.dir:
                    self._dirs_touched.add(probe)
                    probe = probe.parent
        return target

    def record(self, relpath: str | os.PathLike, size: int, crc32: int) -> None:
        """Registers a file already written and fsynced by the caller, with its size and CRC-32."""
        rel = _validate_relpath(relpath)
        with self._mutex:
            self._files[rel] = {"size": int(size), "crc32": f"{crc32 & 0xFFFFFFFF:08x}"}

    def write_bytes(self, relpath: str | os.PathLike, data) -> int:
        """Writes `data` (bytes or any buffer) to `relpath`, fsyncs it, records it; returns its size."""
        target = self.path(relpath)
        size, crc = fsutil.write_file_synced(target, data)
        self.record(relpath, size, crc)
        return size

    def adopt(self, relpath: str | os.PathLike) -> int:
        """Records a file something else wrote into the pending dir: checksums and fsyncs it."""
        target = self.path(relpath)
        size, crc = fsutil.file_crc32(target)
        fsutil.fsync_path(target)
        self.record(relpath, size, crc)
        return size

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        with self._mutex:
            return dict(self._files)

    def forget(self, relpath: str | os.PathLike) -> None:
        """Drops a recorded file (it was renamed or removed by its writer)."""
        with self._mutex:
            self._files.pop(_validate_relpath(relpath), None)

    def finish_rank(self, rank: int) -> Path:
        """fsyncs this rank's directories and writes its part manifest atomically.

        Call after every file of this rank is written (and fsynced). Returns the part path.
        """
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        with self._mutex:
            files = dict(self._files)
            dirs = sorted(self._dirs_touched, key=lambda p: len(p.parts), reverse=True)
        for name in files:
            if not (self.dir / name).is_file():
                raise CommitError(f"{self.tag}: rank {rank} recorded {name} but it is not in {self.dir}")
        for d in dirs:
            fsutil.fsync_dir(d)
        part = {"v": MANIFEST_VERSION, "tag": self.tag, "rank": rank, "files": files,
                "checksum": fsutil.CHECKSUM_ALGO, "host": os.uname().nodename, "pid": os.getpid()}
        path = self.dir / f"{PART_PREFIX}{rank}.json"
        fsutil.write_file_atomic(path, json.dumps(part, sort_keys=True).encode())
        self.finished_ranks.add(rank)
        return path

    def close(self) -> None:
        """Releases the writer lock. After this, a pending dir nobody else holds may be cleaned."""
        self._lock.release()
        self.store._forget_pending(self)

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointStore:
    """Atomic, verifiable checkpoints under one root directory, with retention.

    `keep_last` (>= 1): how many of the newest checkpoints survive retention; checkpoints whose
    metadata has `reason == "notice"` are always kept. Opening a store creates the root and
    removes the leftovers of dead writers (see `cleanup`).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 3, *, clean: bool = True):
        self.keep_last = positive_int("keep_last", keep_last)
        if not str(root):
            raise ConfigError("checkpoint_root", "must not be empty")
        self.root = Path(root).absolute()
        try:
            fsutil.makedirs_durable(self.root)
        except OSError as exc:
            raise ConfigError("checkpoint_root", f"cannot create {self.root}: {exc}") from exc
        if not os.access(self.root, os.W_OK):
            raise ConfigError("checkpoint_root", f"{self.root} is not writable")
        self._pending: dict[str, list[PendingCheckpoint]] = {}
        self._pending_mutex = threading.Lock()
        self._removal_queue: queue.Queue[Path] = queue.Queue()
        self._removal_mutex = threading.Condition()
        self._removals_queued = 0
        self._removal_thread: threading.Thread | None = None
        if clean:
            self.cleanup()

    # ---- writing ---------------------------------------------------------------------------
    def begin(self, tag: str, attempt: str | None = None) -> PendingCheckpoint:
        """Opens `root/.pending-<tag>/` for this rank (same dir on every rank); creates it durably.
        `attempt` (an id the ranks of one save agreed on) is not needed here: the commit checks the
        parts in the one directory every rank writes to; an object store uses it."""
        validate_tag(tag)
        with store_lock(self.root, exclusive=False):
            lock = WriterLock(self.root, tag)
            pending = self._new_pending(tag, lock)
            if not pending.dir.is_dir():
                with contextlib.suppress(FileExistsError):
                    pending.dir.mkdir()
                fsutil.fsync_dir(self.root)
            else:  # left by a refused commit: recovery must not take this dir for a decided one
                with contextlib.suppress(FileNotFoundError):
                    (pending.dir / MANIFEST).unlink()
                    fsutil.fsync_dir(pending.dir)
        with self._pending_mutex:
            self._pending.setdefault(tag, []).append(pending)
        return pending

    def _new_pending(self, tag: str, lock: WriterLock) -> PendingCheckpoint:
        """The pending checkpoint `begin` hands out (a tier above this store returns its own kind)."""
        return PendingCheckpoint(self, tag, lock)

    def _forget_pending(self, pending: PendingCheckpoint) -> None:
        with self._pending_mutex:
            group = self._pending.get(pending.tag, [])
            if pending in group:
                group.remove(pending)
            if not group:
                self._pending.pop(pending.tag, None)

    def commit(self, tag: str, world_size: int, metadata: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Makes `.pending-<tag>` the complete checkpoint `<tag>` (one rank, after a barrier).

        Checks that ranks 0..world_size-1 each wrote a part manifest and that every listed file
        has its recorded size; raises CommitError otherwise (nothing becomes visible). A
        committed checkpoint with the same tag is replaced: it is set aside, not deleted, until
        the new one is in place and named by `latest`. Then applies retention.
        """
        validate_tag(tag)
        world_size = positive_int("world_size", world_size)
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint metadata must be JSON-serializable: {exc}") from None
        pending_dir = self.root / f"{PENDING_PREFIX}{tag}"
        final_dir = self.root / tag
        with store_lock(self.root, exclusive=False):
            if not pending_dir.is_dir():
                raise CommitError(f"{tag}: no pending checkpoint at {pending_dir}")
            files, problems = collect_parts(pending_dir, world_size)
            if problems:
                raise CommitError(f"{tag}: refusing to commit: " + "; ".join(problems))
            sequence = 1 + max((c.sequence for c in self.list()), default=0)
            manifest = {"v": MANIFEST_VERSION, "tag": tag, "sequence": sequence, "world_size": world_size,
                        "committed_at": time.time(), "checksum": fsutil.CHECKSUM_ALGO,
                        "metadata": metadata, "files": files}
            raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
            fsutil.write_file_atomic(pending_dir / MANIFEST, raw)
            replaced = self._install(pending_dir, final_dir)
            fsutil.write_file_atomic(self.root / LATEST, tag.encode())
        with self._pending_mutex:
            mine = list(self._pending.get(tag, []))
        for pending in mine:
            pending.close()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        info = self._info_from_manifest(final_dir, manifest, fingerprint(raw))
        self.apply_retention(protect={tag}, remove_later=True)
        log.info("checkpoint %s committed (sequence %d, %d files, %.1f MB)", tag, sequence, len(files),
                 info.size / 1e6, extra={"tag": tag, "step": info.step})
        return info

    def _install(self, pending_dir: Path, final_dir: Path) -> Path | None:
        """Renames the pending dir (manifest written) to `<tag>`; returns where an existing `<tag>`
        was set aside. If the rename fails, the old copy is put back and the manifest removed."""
        replaced = None
        try:
            if os.path.lexists(final_dir):
                log.warning("checkpoint %s exists; replacing it with the new commit", final_dir.name)
                replaced = self.root / aside_name(REPLACED_PREFIX, final_dir.name)
                os.rename(final_dir, replaced)
            os.rename(pending_dir, final_dir)
        except OSError:
            if replaced is not None:
                with contextlib.suppress(OSError):
                    os.rename(replaced, final_dir)
            with contextlib.suppress(OSError):
                (pending_dir / MANIFEST).unlink()
            raise
        fsutil.fsync_dir(self.root)
        return replaced

    # ---- reading ---------------------------------------------------------------------------
    def _info_from_manifest(self, directory: Path, manifest: dict[str, Any], identity: str) -> CheckpointInfo:
        return CheckpointInfo(tag=manifest["tag"], dir=directory, sequence=int(manifest["sequence"]),
                              world_size=int(manifest["world_size"]), metadata=dict(manifest.get("metadata") or {}),
                              files=dict(manifest["files"]), committed_at=float(manifest.get("committed_at", 0.0)),
                              fingerprint=identity)

    def read(self, tag: str) -> CheckpointInfo | None:
        """The committed checkpoint `<tag>`, or None when absent or without a readable manifest."""
        directory = self.root / validate_tag(tag)
        try:
            manifest, raw = read_manifest(directory, tag)
            return self._info_from_manifest(directory, manifest, fingerprint(raw))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint %s: manifest unreadable (%s); ignoring it", tag, exc)
            return None

    def list(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest first (by commit sequence)."""
        found = []
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or not entry.is_dir() or not TAG_RE.match(entry.name):
                continue
            info = self.read(entry.name)
            if info is not None:
                found.append(info)
        found.sort(key=lambda c: (c.sequence, c.committed_at, c.tag))
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint (manifest present); no checksum pass."""
        complete = self.list()
        return complete[-1] if complete else None

    def verify(self, info: CheckpointInfo) -> None:
        """Recomputes every file's size and CRC-32; raises CheckpointCorrupt listing the damage."""
        problems = []
        for name, entry in sorted(info.files.items()):
            path = info.dir / name
            try:
                size, crc = fsutil.file_crc32(path)
            except FileNotFoundError:
                problems.append(f"{name} is missing")
                continue
            except OSError as exc:
                problems.append(f"{name} unreadable: {exc}")
                continue
            if size != entry["size"]:
                problems.append(f"{name} has {size} bytes, manifest says {entry['size']}")
            elif f"{crc:08x}" != entry["crc32"]:
                problems.append(f"{name} checksum {crc:08x} != {entry['crc32']}")
        if problems:
            raise CheckpointCorrupt(info.tag, problems)

    def resolve(self, verify: bool = True) -> CheckpointInfo | None:
        """The newest complete checkpoint whose checksums verify, falling back to older ones.

        Each fallback is logged as a warning naming the damage. None when there is no complete
        checkpoint at all; CheckpointCorrupt when there are some but none verifies (starting
        from scratch silently would throw training away).
        """
        candidates = self.list()
        if not verify:
            return candidates[-1] if candidates else None
        return newest_that_checks(candidates, self.verify)

    # ---- housekeeping ------------------------------------------------------------------------
    def _trash(self, directory: Path, *, later: bool = False) -> None:
        """Renames `directory` to a `.trash-*` name (invisible at once, durably), then deletes it: now,
        or with `later` on the store's removal thread (`removals_done`)."""
        trash = self.root / aside_name(TRASH_PREFIX, directory.name)
        os.rename(directory, trash)
        fsutil.fsync_dir(self.root)
        if later:
            self._remove_later(trash)
        else:
            shutil.rmtree(trash, ignore_errors=True)

    def _remove_later(self, trash: Path) -> None:
        with self._removal_mutex:
            self._removals_queued += 1
            if self._removal_thread is None or not self._removal_thread.is_alive():
                self._removal_thread = threading.Thread(target=self._remove_queued, name="spotguard-retention",
                                                        daemon=True)
                self._removal_thread.start()
            self._removal_queue.put(trash)  # under the mutex: the thread ends only with an empty queue

    def _remove_queued(self) -> None:
        while True:
            try:
                trash = self._removal_queue.get(timeout=5.0)
            except queue.Empty:
                with self._removal_mutex:
                    if self._removal_queue.empty():
                        self._removal_thread = None
                        return
                continue
            shutil.rmtree(trash, ignore_errors=True)
            with self._removal_mutex:
                self._removals_queued -= 1
                self._removal_mutex.notify_all()

    def removals_done(self, timeout: float | None = None) -> bool:
        """Waits until the checkpoints retention set aside at a commit are deleted; False on timeout.
        (A process that ends first leaves `.trash-*` names, which the next open removes.)"""
        with self._removal_mutex:
            return self._removal_mutex.wait_for(lambda: self._removals_queued == 0, timeout)

    def derived(self, kind: str) -> DerivedCopies:
        """The copies of kind `kind` derived from this store's checkpoints (`<root>/_<kind>/`, derived.py)."""
        return DerivedCopies(self.root, kind)

    def _prune_derived(self) -> builtins.list[str]:
        """Removes derived copies except those made from one of the newest `keep_last` checkpoints as committed now."""
        areas = derived_areas(self.root)
        if not areas:
            return []
        keep = self.list()[-self.keep_last:]
        return [f"_{area.kind}/{name}" for area in areas for name in area.prune(keep)]

    def apply_retention(self, protect: AbstractSet[str] = frozenset(), *,
                        remove_later: bool = False) -> builtins.list[str]:
        """Deletes complete checkpoints beyond the newest `keep_last`, except notice ones; returns tags removed.

        Derived copies (derived.py) are kept only for the newest `keep_last` checkpoints. With
        `remove_later` (a commit: freeing a checkpoint's files is no part of making the new one
        durable, and takes ext4 ~0.35 s per 500 MB here) the removed checkpoints are renamed out of
        sight now and deleted on the store's removal thread (`removals_done`).
        """
        complete = self.list()
        keep = {c.tag for c in complete[-self.keep_last:]} | set(protect)
        keep |= {c.tag for c in complete if c.metadata.get("reason") == "notice"}
        removed = []
        for info in complete:
            if info.tag in keep:
                continue
            try:
                self._trash(info.dir, later=remove_later)
                removed.append(info.tag)
            except OSError as exc:
                log.warning("retention: cannot remove %s: %s", info.tag, exc)
        pruned = self._prune_derived()
        if removed or pruned:
            log.info("retention removed %s", ", ".join(removed + pruned))
        return removed

    def cleanup(self) -> builtins.list[str]:
        """Finishes or undoes commits a crash interrupted, then removes leftovers of dead writers.

        First the newest complete copy of every tag (a decided pending commit, or a copy set aside
        by a re-commit) becomes `<tag>/` again and `latest` names the newest checkpoint
        (recovery.py); only then are pending dirs, set-aside copies, trash and temp files
        deleted, and derived copies pruned. Returns the names removed. A pending dir is left
        alone while any writer still holds its lock (see locks.py).
        """
        removed = []
        with store_lock(self.root, exclusive=True):
            live = live_tags_reaping_dead(self.root)
            recovered = recover_commits(self.root, live)
            for entry in self.root.iterdir():
                name = entry.name
                try:
                    if name.startswith(PENDING_PREFIX) and name[len(PENDING_PREFIX):] not in live:
                        if entry.is_dir():
                            self._trash(entry)
                        else:
                            entry.unlink()
                    elif name.startswith((TRASH_PREFIX, REPLACED_PREFIX)):
                        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
                    elif name.startswith(f".{LATEST}.tmp-"):
                        entry.unlink()
                    else:
                        continue
                except FileNotFoundError:
                    continue
                removed.append(name)
            if removed:
                fsutil.fsync_dir(self.root)
            newest = self.latest()
            repair_latest(self.root, newest.tag if newest is not None else None)
            removed += self._prune_derived()
        if recovered:
            log.warning("finished checkpoint commits a crash interrupted: %s", ", ".join(recovered))
        if removed:
            log.warning("removed leftovers of interrupted checkpoint writers: %s", ", ".join(sorted(removed)))
        return removed

    # ---- framework plug-ins ---------------------------------------------------------------------
    def dcp_writer(self, pending: PendingCheckpoint, **options):
        """A torch.distributed.checkpoint StorageWriter writing into `pending.dir` (see dcp.py)."""
        from .dcp import StoreDcpWriter

        return StoreDcpWriter(pending, **options)

    def dcp_reader(self, info: CheckpointInfo, **options):
        """A torch.distributed.checkpoint StorageReader over a committed checkpoint."""
        from .dcp import StoreDcpReader

        return StoreDcpReader(info.dir, **options)

    def deepspeed_engine(self, **options):
        """Removed (issue 21): DeepSpeed saves through `DeepSpeedAdapter(engine, store=store)`."""
        raise RuntimeError("CheckpointStore.deepspeed_engine() was removed: use "
                           "spotguard.hooks.adapters.deepspeed.DeepSpeedAdapter(engine, store=store).save(step)")


def newest_that_checks(candidates: list[CheckpointInfo],
                       check: Callable[[CheckpointInfo], None]) -> CheckpointInfo | None:
    """The newest of `candidates` (oldest first) for which `check` (verify, or download and verify)
    raises no CheckpointCorrupt, falling back to older ones with a warning naming the damage.
    None when there are no candidates; CheckpointCorrupt when there are some but none checks
    (starting from scratch silently would throw training away)."""
    failures: list[CheckpointCorrupt] = []
    for info in reversed(candidates):
        try:
            check(info)
        except CheckpointCorrupt as exc:
            failures.append(exc)
            log.warning("checkpoint %s failed verification, falling back to an older one: %s", info.tag, exc,
                        extra={"tag": info.tag})
            continue
        if failures:
            log.warning("resuming from %s (step %s) instead of the damaged %s", info.tag, info.step,
                        ", ".join(f.tag for f in failures))
        return info
    if failures:
        raise CheckpointCorrupt(failures[0].tag, [f"no checkpoint verifies: {f}" for f in failures])
    return None


def open_store(location: str | os.PathLike, keep_last: int = 3, **options: Any) -> Any:
    """The store for `location`: `s3://bucket/prefix` opens an ObjectCheckpointStore (options: see
    objectstore/store.py), anything else a CheckpointStore on that directory."""
    from .objectstore.url import is_object_store_url

    if is_object_store_url(location):
        from .objectstore.store import ObjectCheckpointStore

        return ObjectCheckpointStore(str(location), keep_last=keep_last, **options)
    return CheckpointStore(location, keep_last=keep_last, **options)
