"""A checkpoint file written front to back with direct I/O: the bytes go from a small aligned
buffer to the device, never through the page cache.

Why: a buffered write copies every byte into page-cache pages the kernel must find first, and on a
VM (firecracker here) a page the guest never touched costs a fault on the host: 240 MiB took 0.54 s
of CPU buffered the first time, 0.06 s direct, and the write's CPU is what an in-place change's
survivors wait on (bench/direct_write.py prints both). A checkpoint is written once and read back
rarely, so the page cache holds nothing it needs.

Contract: `sequential_file(path)` creates/truncates `path` and yields a `SequentialFile`;
`write(data)` (any buffer, any length) appends; when the block ends without an exception the file
holds exactly the bytes written, fsynced, and `size` / `crc` (CRC-32, fsutil's) describe them. On
an exception the descriptor is closed and the partial file left to the caller's cleanup.
- With O_DIRECT (`direct` True) the bytes are copied into a `BOUNCE`-byte page-aligned buffer
  (one per open file, taken from a pool the process keeps) and written in whole blocks; the
  last partial block is padded with zeros, written, and the file truncated to its length.
- Without it (`SPOTGUARD_DIRECT_IO=0`, a file system that refuses O_DIRECT at open or at the
  first write, e.g. tmpfs or some network file systems) the file is written through the page
  cache, its pages written back behind the writer (`fsutil.flushing_behind`), then fsynced:
  the same bytes, the same durability.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from spotguard.config import one_of
from spotguard.wire.names import ENV_DIRECT_IO

from . import fsutil

BLOCK = 4096  # O_DIRECT's alignment of memory, offsets and lengths (a multiple of any device's sector)
BOUNCE = 4 << 20  # 4 MiB per open file: the syscall size at which the device is already at full speed
POOL_KEPT = 8  # bounce buffers the process keeps between saves (one per file written at once)
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)

_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def direct_io_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether checkpoint files are written with O_DIRECT (`SPOTGUARD_DIRECT_IO`: "1" (default) or
    "0"); another value raises `ConfigError` naming the variable (the store checks it when made)."""
    value = (os.environ if env is None else env).get(ENV_DIRECT_IO, "1").strip().lower()
    return one_of(ENV_DIRECT_IO, value or "1", ("1", "0", "true", "false", "on", "off")) in ("1", "true", "on")


class SequentialFile:
    """An open file written front to back (module docstring)."""

    def __init__(self, fd: int, bounce: memoryview | None):
        """`bounce`: an aligned buffer of a whole number of blocks for a descriptor opened with
        O_DIRECT (None: a buffered descriptor)."""
        self.fd, self._view = fd, bounce
        self._filled = 0  # bytes in the bounce buffer not written yet
        self.size = 0
        self.crc = 0

    @property
    def direct(self) -> bool:
        return self._view is not None

    def write(self, data) -> int:
        """Appends all of `data`; returns its length."""
        view = memoryview(data).cast("B")
        if self._view is None:
            self.crc = zlib.crc32(view, self.crc)
            _write_all(self.fd, view)
        else:
            pos = 0
            while pos < len(view):
                take = min(len(self._view) - self._filled, len(view) - pos)
                chunk = self._view[self._filled:self._filled + take]
                chunk[:] = view[pos:pos + take]
                self.crc = zlib.crc32(chunk, self.crc)  # read while the copy is in the cache
                self._filled += take
                pos += take
                if self._filled == len(self._view):
                    self._drain(self._filled)
        self.size += len(view)
        return len(view)

    def finish(self) -> None:
        """The last partial block padded, written and cut off; the file fsynced."""
        if self._view is not None and self._filled:
            padded = -(-self._filled // BLOCK) * BLOCK
            self._view[self._filled:padded] = bytes(padded - self._filled)
            self._drain(padded)
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)

    def _drain(self, length: int) -> None:
        """Writes the bounce buffer's first `length` bytes (a whole number of blocks unless direct
        I/O was refused); a refusal (at the first write, or at the padded tail of a file system
        whose direct I/O wants more than `BLOCK`) turns O_DIRECT off for this file."""
        assert self._view is not None
        try:
            _write_all(self.fd, self._view[:length])
        except OSError as exc:  # a refused write wrote nothing: the same bytes again, buffered
            if exc.errno not in _REFUSED:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _write_all(self.fd, self._view[:length])
        self._filled = 0

    def release(self) -> None:
        """Lets go of the bounce buffer (its view released, so the buffer can be reused or closed)."""
        if self._view is not None:
            self._view.release()
            self._view = None


@contextlib.contextmanager
def sequential_file(path: Path | str, *, direct: bool | None = None) -> Iterator[SequentialFile]:
    """See the module docstring; `direct` None reads `SPOTGUARD_DIRECT_IO`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = -1
    if direct_io_enabled() if direct is None else direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
    bounce = None
    if fd >= 0:
        try:
            bounce = _take()
        except BaseException:
            os.close(fd)
            raise
    else:
        fd = os.open(path, flags, 0o644)
    file = SequentialFile(fd, memoryview(bounce) if bounce is not None else None)
    try:
        with contextlib.nullcontext() if file.direct else fsutil.flushing_behind(fd):
            yield file
        file.finish()
    finally:
        file.release()
        os.close(fd)
        if bounce is not None:
            _give_back(bounce)


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def _take() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return mmap.mmap(-1, BOUNCE)  # anonymous: page-aligned, as O_DIRECT needs


def _give_back(bounce: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < POOL_KEPT:
            _pool.append(bounce)
            return
    with contextlib.suppress(BufferError):  # a traceback still holds a view: the collector frees it later
        bounce.close()
