"""Liveness of checkpoint writers, told by flock(2) locks the kernel drops when a process dies.

Layout under the store root:
- `.store.lock`: writers hold it shared while they create or commit a pending checkpoint;
  the cleanup of dead writers' leftovers holds it exclusive, so it never races a live begin;
- `.locks/<tag>.<id>.lock`: one per live writer of `<tag>`, held exclusive for as long as
  that writer may still add to `.pending-<tag>/`.

A lock file nobody holds belongs to a dead (or finished) writer. On NFS, Linux maps flock to
POSIX byte-range locks, so this also works on a shared PVC.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from pathlib import Path
from collections.abc import Iterator

LOCK_DIR = ".locks"
STORE_LOCK = ".store.lock"


@contextlib.contextmanager
def store_lock(root: Path, *, exclusive: bool) -> Iterator[None]:
    """Holds `root/.store.lock` shared (writers) or exclusive (cleanup) for the block."""
    fd = os.open(root / STORE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class WriterLock:
    """An exclusive flock on a fresh lock file for `tag`; released by `release()` or process death."""

    def __init__(self, root: Path, tag: str):
        self.path = root / LOCK_DIR / f"{tag}.{uuid.uuid4().hex[:16]}.lock"
        self.path.parent.mkdir(exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drops the lock and removes its file. Idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)


def tag_of_lock(path: Path) -> str:
    """`<tag>` of a `.locks/<tag>.<id>.lock` file name."""
    return path.name[: -len(".lock")].rsplit(".", 1)[0]


def live_tags_reaping_dead(root: Path) -> set[str]:
    """Tags that still have a live writer; lock files of dead writers are removed on the way.

    Call only while holding the store lock exclusive.
    """
    live: set[str] = set()
    lock_dir = root / LOCK_DIR
    if not lock_dir.is_dir():
        return live
    for path in lock_dir.glob("*.lock"):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(tag_of_lock(path))
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        finally:
            os.close(fd)
    return live
