"""`PendingDirectory`: the `PendingCheckpoint` of a store on disk, one rank's view of `.pending-<tag>/`.

Every rank of a save writes into the same `<root>/.pending-<tag>/` and ends with its part manifest
`.spotguard-part-<rank>.json` (its files, sizes, CRC-32s), written atomically after the files and
their directories were fsynced: the commit (store.py) takes a rank's files only through it. The
writer lock (locks.py) is held until `close()`, so another process's cleanup leaves the directory
alone meanwhile. `on_part(pending, rank, part_path)`, when given, runs after the part manifest is
written (the object store queues the upload of the part there).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import fsutil
from .locks import WriterLock
from .manifest import MANIFEST, MANIFEST_VERSION, PART_PREFIX, PENDING_PREFIX
from .types import CommitError, PendingCheckpoint

PartFinished = Callable[["PendingDirectory", int, Path], None]


def validate_relpath(relpath: str | os.PathLike) -> str:
    """`relpath` as a POSIX path inside a checkpoint, else ValueError (absolute, `..`, reserved names)."""
    rel = Path(relpath)
    if rel.is_absolute() or not rel.parts or any(p in ("", ".", "..") for p in rel.parts):
        raise ValueError(f"invalid file name in a checkpoint: {str(relpath)!r}")
    if rel.name == MANIFEST or rel.name.startswith(PART_PREFIX):
        raise ValueError(f"{str(relpath)!r} is reserved by the checkpoint store")
    return rel.as_posix()


class PendingDirectory(PendingCheckpoint):
    """One rank's part of `<root>/.pending-<tag>/` (see the module docstring and `PendingCheckpoint`)."""

    def __init__(self, root: Path, tag: str, lock: WriterLock, *, attempt: str | None = None,
                 on_close: Callable[[PendingDirectory], None] | None = None, on_part: PartFinished | None = None):
        self.tag = tag
        self.dir = root / f"{PENDING_PREFIX}{tag}"
        self.attempt = attempt
        self._lock = lock
        self._on_close = on_close
        self._on_part = on_part
        self._files: dict[str, dict[str, Any]] = {}
        self._dirs_touched: set[Path] = {self.dir}
        self._mutex = threading.Lock()

    def path(self, relpath: str | os.PathLike) -> Path:
        rel = validate_relpath(relpath)
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
        rel = validate_relpath(relpath)
        with self._mutex:
            self._files[rel] = {"size": int(size), "crc32": f"{crc32 & 0xFFFFFFFF:08x}"}

    def write_bytes(self, relpath: str | os.PathLike, data: Any) -> int:
        target = self.path(relpath)
        size, crc = fsutil.write_file_synced(target, data)
        self.record(relpath, size, crc)
        return size

    def adopt(self, relpath: str | os.PathLike) -> int:
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
        with self._mutex:
            self._files.pop(validate_relpath(relpath), None)

    def finish_rank(self, rank: int) -> Path:
        """fsyncs this rank's directories and writes its part manifest atomically; returns its path.
        Call after every file of this rank is written (and fsynced)."""
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
        if self._on_part is not None:
            self._on_part(self, rank, path)
        return path

    def close(self) -> None:
        """Releases the writer lock. After this, a pending dir nobody else holds may be cleaned."""
        self._lock.release()
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> PendingDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
