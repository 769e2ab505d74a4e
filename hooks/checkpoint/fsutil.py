"""Durable file primitives the store is built on: fsync'd writes, directory fsync, checksums.

Contract: a function here returns only after the bytes (and, where stated, the directory
entry) are on stable storage as far as fsync can promise. Checksums are CRC-32 (zlib), which
runs at several GB/s here and detects torn or damaged files; it is not a cryptographic hash.
"""
from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

CHUNK = 8 << 20
CHECKSUM_ALGO = "crc32"


def fsync_dir(path: Path | str) -> None:
    """fsyncs a directory so the entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: Path) -> None:
    """Creates `path` and any missing parents, fsyncing each parent whose entries changed."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    path.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


def write_fd_all(fd: int, data, crc: int = 0) -> tuple[int, int]:
    """Writes all of `data` (any buffer) to `fd` in chunks; returns (bytes written, running crc32)."""
    view = memoryview(data).cast("B")
    pos, total = 0, len(view)
    while pos < total:
        chunk = view[pos:pos + CHUNK]
        crc = zlib.crc32(chunk, crc)
        written = 0
        while written < len(chunk):
            written += os.write(fd, chunk[written:])
        pos += len(chunk)
    return total, crc


def write_file_synced(path: Path, data) -> tuple[int, int]:
    """Creates/truncates `path`, writes `data`, fsyncs the file; returns (size, crc32).

    The directory entry is not fsynced here (callers batch that per directory).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size, crc = write_fd_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically: temp file, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write_file_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_crc32(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file's content, read in chunks."""
    crc, size = 0, 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


class ChecksumWriter(io.RawIOBase):
    """A write-only stream over the binary file `raw` that keeps the CRC-32 (`crc`) and byte count
    (`size`) of everything written through it: a file's checksum as it streams out, never read back."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        written = self.raw.write(view)
        self.size += len(view)
        return written if written is not None else len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()


def fsync_path(path: Path) -> None:
    """fsyncs an existing file by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def flushing_behind(fd: int, interval: float = 0.02) -> Iterator[None]:
    """While the block writes to `fd`, a thread keeps writing its dirty pages back (fdatasync in a
    loop), so the fsync after the block finds little left: a writer that buffers everything and
    fsyncs at the end pays the write and the flush one after the other. Not a durability
    promise by itself: the caller still fsyncs `fd` after the block. An error the thread's
    fdatasync got is raised when the block ends (Linux reports a writeback error to one fsync
    only, so it must not be swallowed here)."""
    stop = threading.Event()
    failed: list[OSError] = []

    def flush() -> None:
        while True:  # at least once: a block too short for a second pass still checks the file
            try:
                os.fdatasync(fd)
            except OSError as exc:
                failed.append(exc)
                return
            if stop.wait(interval):
                return

    thread = threading.Thread(target=flush, name="spotguard-flush-behind", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]


def fsync_tree(root: Path) -> None:
    """fsyncs every file under `root`, then every directory bottom-up (for trees written by other tools)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_dir(dirpath)
