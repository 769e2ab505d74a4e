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

This store implements `types.Store`, as `objectstore.store.ObjectCheckpointStore` does (this
store as its local first tier, the object store as the tier that survives the node);
`factory.open_store(location)` opens one or the other. A rank's part is a `pending.PendingDirectory`.
"""
from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError, positive_int

from . import fsutil
from .direct_file import direct_io_enabled
from .derived import DerivedCopies, derived_areas
from .locks import WriterLock, live_tags_reaping_dead, store_lock
from .manifest import (LATEST, MANIFEST, MANIFEST_VERSION, PENDING_PREFIX, REPLACED_PREFIX, TAG_RE, TRASH_PREFIX,
                       aside_name, collect_parts, fingerprint, read_manifest, validate_tag)
from .pending import PartFinished, PendingDirectory
from .recovery import recover_commits, repair_latest
from .removal import BackgroundRemoval
from .types import CheckpointCorrupt, CheckpointInfo, CommitError, PendingCheckpoint, Store
from .verify import newest_that_checks, verify_files

log = logging.getLogger(__name__)

# CheckpointCorrupt, CommitError, PendingCheckpoint (types.py) and validate_tag (manifest.py) were
# defined here: their old import path keeps working.
__all__ = ["MANIFEST", "CheckpointCorrupt", "CheckpointInfo", "CheckpointStore", "CommitError", "PendingCheckpoint",
           "validate_tag"]


def install(root: Path, pending_dir: Path, final_dir: Path) -> Path | None:
    """Renames the pending dir (manifest written) to `<tag>` in `root`; returns where an existing
    `<tag>` was set aside. If the rename fails, the old copy is put back and the manifest removed."""
    replaced = None
    try:
        if os.path.lexists(final_dir):
            log.warning("checkpoint %s exists; replacing it with the new commit", final_dir.name)
            replaced = root / aside_name(REPLACED_PREFIX, final_dir.name)
            os.rename(final_dir, replaced)
        os.rename(pending_dir, final_dir)
    except OSError:
        if replaced is not None:
            with contextlib.suppress(OSError):
                os.rename(replaced, final_dir)
        with contextlib.suppress(OSError):
            (pending_dir / MANIFEST).unlink()
        raise
    fsutil.fsync_dir(root)
    return replaced


def info_from_manifest(directory: Path, manifest: dict[str, Any], identity: str) -> CheckpointInfo:
    """The CheckpointInfo of a manifest read from `directory` (`identity`: its fingerprint)."""
    return CheckpointInfo(tag=manifest["tag"], dir=directory, sequence=int(manifest["sequence"]),
                          world_size=int(manifest["world_size"]), metadata=dict(manifest.get("metadata") or {}),
                          files=dict(manifest["files"]), committed_at=float(manifest.get("committed_at", 0.0)),
                          fingerprint=identity)


class CheckpointStore(Store):
    """Atomic, verifiable checkpoints under one root directory, with retention.

    `keep_last` (>= 1): how many of the newest checkpoints survive retention; checkpoints whose
    metadata has `reason == "notice"` are always kept. Opening a store creates the root and
    removes the leftovers of dead writers (see `cleanup`). `on_part(pending, rank, part_path)`:
    called when a rank's part manifest is written (the object store's tier above this one).
    """

    agrees_attempts = False  # every rank writes into the one `.pending-<tag>/`: the commit checks it

    def __init__(self, root: str | os.PathLike, keep_last: int = 3, *, clean: bool = True,
                 on_part: PartFinished | None = None):
        self.keep_last = positive_int("keep_last", keep_last)
        direct_io_enabled()  # SPOTGUARD_DIRECT_IO checked now, not at the first save
        if not str(root):
            raise ConfigError("checkpoint_root", "must not be empty")
        self._root = Path(root).absolute()
        try:
            fsutil.makedirs_durable(self.root)
        except OSError as exc:
            raise ConfigError("checkpoint_root", f"cannot create {self.root}: {exc}") from exc
        if not os.access(self.root, os.W_OK):
            raise ConfigError("checkpoint_root", f"{self.root} is not writable")
        self._on_part = on_part
        self._pending: dict[str, list[PendingDirectory]] = {}
        self._pending_mutex = threading.Lock()
        self._removal = BackgroundRemoval()
        if clean:
            self.cleanup()

    @property
    def root(self) -> Path:
        return self._root

    # ---- writing ---------------------------------------------------------------------------
    def begin(self, tag: str, attempt: str | None = None) -> PendingDirectory:
        """Opens `root/.pending-<tag>/` for this rank (same dir on every rank); creates it durably.
        `attempt` (an id the ranks of one save agreed on) is not needed here: the commit checks the
        parts in the one directory every rank writes to; the pending checkpoint carries it."""
        validate_tag(tag)
        with store_lock(self.root, exclusive=False):
            lock = WriterLock(self.root, tag)
            pending = PendingDirectory(self.root, tag, lock, attempt=attempt, on_close=self._forget_pending,
                                       on_part=self._on_part)
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

    def _forget_pending(self, pending: PendingDirectory) -> None:
        with self._pending_mutex:
            group = self._pending.get(pending.tag, [])
            if pending in group:
                group.remove(pending)
            if not group:
                self._pending.pop(pending.tag, None)

    def release(self, tag: str) -> None:
        """Closes this process's pending checkpoints of `tag`: their writers are done (committed
        here, or in the tier above when the parts lie on several nodes)."""
        with self._pending_mutex:
            mine = list(self._pending.get(tag, []))
        for pending in mine:
            pending.close()

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
            replaced = install(self.root, pending_dir, final_dir)
            fsutil.write_file_atomic(self.root / LATEST, tag.encode())
        self.release(tag)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        info = info_from_manifest(final_dir, manifest, fingerprint(raw))
        self.apply_retention(protect={tag}, remove_later=True)
        log.info("checkpoint %s committed (sequence %d, %d files, %.1f MB)", tag, sequence, len(files),
                 info.size / 1e6, extra={"tag": tag, "step": info.step})
        return info

    # ---- reading ---------------------------------------------------------------------------
    def read(self, tag: str) -> CheckpointInfo | None:
        """The committed checkpoint `<tag>`, or None when absent or without a readable manifest."""
        directory = self.root / validate_tag(tag)
        try:
            manifest, raw = read_manifest(directory, tag)
            return info_from_manifest(directory, manifest, fingerprint(raw))
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
        verify_files(info)

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
            self._removal.remove(trash)
        else:
            shutil.rmtree(trash, ignore_errors=True)

    def removals_done(self, timeout: float | None = None) -> bool:
        """Waits until the checkpoints retention set aside at a commit are deleted; False on timeout.
        (A process that ends first leaves `.trash-*` names, which the next open removes.)"""
        return self._removal.done(timeout)

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

    # ---- framework plug-ins: dcp.py, torchfile.py, torchshards.py write into any PendingCheckpoint --
    def dcp_writer(self, pending: PendingCheckpoint, **options: Any) -> Any:
        """Deprecated: `spotguard.hooks.checkpoint.dcp.StoreDcpWriter(pending, **options)`."""
        from .dcp import deprecated_writer

        return deprecated_writer(pending, **options)

    def dcp_reader(self, info: CheckpointInfo, **options: Any) -> Any:
        """Deprecated: `spotguard.hooks.checkpoint.dcp.StoreDcpReader(info.dir, **options)`."""
        from .dcp import deprecated_reader

        return deprecated_reader(info, **options)

    def deepspeed_engine(self, **options: Any) -> Any:
        """Removed (issue 21): DeepSpeed saves through `DeepSpeedAdapter(engine, store=store)`."""
        raise RuntimeError("CheckpointStore.deepspeed_engine() was removed: use "
                           "spotguard.hooks.adapters.deepspeed.DeepSpeedAdapter(engine, store=store).save(step)")
