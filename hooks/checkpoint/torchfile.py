"""Durable `torch.save` files inside a pending checkpoint.

Contract: `save_torch_file(pending, relpath, obj)` writes `obj` with `torch.save` straight to
its file in the pending directory (no serialized copy in memory) through a stream that keeps the
CRC-32 of every byte as it goes out (fsutil.ChecksumWriter: the file is never read back), while a
thread writes the file's pages back behind it (`fsutil.flushing_behind`: the write and the flush
overlap); then fsyncs it and records it in the pending checkpoint. It returns only once the file
is durable; the format is plain `torch.save`, so `torch.load` reads it. Several calls may run at
once in threads (torchshards.py writes a state's shards so).

`save_torch_file_spread(pending, relpath, obj)` makes the same file (the same bytes but the zip
records' own CRC-32 fields, left 0; torch.load reads it) with the work split: torch.save lays the
file out in milliseconds (no copy, no zip CRC), writer threads write it while the file's CRC-32 is
computed beside them: for one large file a framework's format requires (a Lightning `.ckpt`, the
Trainer's `optimizer.pt`), where `save_torch_file` does all of it on one thread.
"""
from __future__ import annotations

import io
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from typing import IO, Any, cast

import numpy
import torch
from torch.utils._pytree import tree_leaves

from . import fsutil
from .types import PendingCheckpoint


def save_torch_file(pending: PendingCheckpoint, relpath: str, obj: Any) -> int:
    """Writes, fsyncs and records `relpath`; returns its size (see the module docstring)."""
    path = pending.path(relpath)
    with open(path, "wb") as file:
        stream = fsutil.ChecksumWriter(file)
        with fsutil.flushing_behind(file.fileno()):
            torch.save(obj, cast(IO[bytes], stream))
            file.flush()
        os.fsync(file.fileno())
    pending.record(relpath, stream.size, stream.crc)
    return stream.size


SPREAD_MIN = 1 << 20  # a write at least this large that lies in a tensor of the object is written later, in place
SPREAD_CHUNK = 16 << 20  # the pieces the writer threads take
# Writer threads per file: 1. Here buffered writes to one file serialize on its inode: 500 MB, quiet, 3
# rounds: 1 writer 1.00-1.58x the raw write, 2: 1.11-1.32x, 4: 1.25-1.34x, 8: 1.28-1.42x (noisy, no gain).
SPREAD_WRITERS = 1
_spreaders = ThreadPoolExecutor(16, thread_name_prefix="spotguard-spread")


class _ZipCrcOff:
    """Inside: `torch.save` writes no CRC-32 into its zip records (torch's own switch, process-wide,
    so one block at a time; the block is the layout, milliseconds). torch.load reads such files; the
    store's CRC-32 of the whole file is what verifies them. Without it torch.save checksums every
    byte on the one thread that lays the file out (~0.5 s for 500 MB here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept = True

    def __enter__(self) -> None:
        from torch.utils.serialization import config

        self._lock.acquire()
        self._kept, config.save.compute_crc32 = config.save.compute_crc32, False

    def __exit__(self, *exc: Any) -> None:
        from torch.utils.serialization import config

        config.save.compute_crc32 = self._kept
        self._lock.release()


_zip_crc_off = _ZipCrcOff()


class _LaidOut(io.RawIOBase):
    """A write-only stream that lays `torch.save`'s output out instead of writing it: the file as
    (offset, bytes-like) segments. A write of >= `min_kept` bytes that lies wholly inside the memory
    of one of the object's CPU tensors is kept by reference (torch.save hands a tensor's storage over
    without copying it); every other write is copied (it may be a temporary)."""

    def __init__(self, obj: Any, min_kept: int, name: str):
        super().__init__()
        self.name = name  # the file it lays out (as an open file's `name`)
        self.min_kept = min_kept
        self.size = 0
        self.segments: list[tuple[int, Any]] = []
        storages = [t.untyped_storage() for t in tree_leaves(obj)
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        self._owned = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages)

    def writable(self) -> bool:
        return True

    def _inside_a_tensor(self, view: memoryview) -> bool:
        start = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        end = start + len(view)
        return any(low <= start and end <= high for low, high in self._owned)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        kept = view if len(view) >= self.min_kept and self._inside_a_tensor(view) else bytes(view)
        self.segments.append((self.size, kept))
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size


def lay_out(obj: Any, name: str = "", min_kept: int = SPREAD_MIN) -> _LaidOut:
    """`torch.save(obj)`'s file as (offset, bytes-like) `segments` and its `size`, nothing written: the
    bytes of its tensors (writes of >= `min_kept` bytes inside a CPU tensor's memory) by reference, so
    they must not change until the segments are written; the zip records without their CRC-32
    (`_ZipCrcOff`: torch.load needs none, the store's CRC-32 of the file verifies it)."""
    laid_out = _LaidOut(obj, min_kept, name)
    with _zip_crc_off:
        torch.save(obj, cast(IO[bytes], laid_out))
    return laid_out


def _pieces(segments: list[tuple[int, Any]], chunk: int) -> list[tuple[int, Any]]:
    """The segments as pwrite pieces: consecutive copied ones joined, those kept by reference cut to `chunk`."""
    pieces: list[tuple[int, Any]] = []
    small: list[bytes] = []
    small_at = 0
    for offset, data in segments:
        if isinstance(data, bytes):
            if not small:
                small_at = offset
            small.append(data)
            continue
        if small:
            pieces.append((small_at, b"".join(small)))
            small = []
        view = memoryview(data)
        pieces += [(offset + at, view[at:at + chunk]) for at in range(0, len(view), chunk)]
    if small:
        pieces.append((small_at, b"".join(small)))
    return pieces


def _pwrite_all(fd: int, pieces: list[tuple[int, Any]]) -> None:
    for offset, data in pieces:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)


def save_torch_file_spread(pending: PendingCheckpoint, relpath: str, obj: Any, *, min_kept: int = SPREAD_MIN,
                           chunk: int = SPREAD_CHUNK, writers: int = SPREAD_WRITERS) -> int:
    """`save_torch_file` for one large file written by several threads at once: `torch.save` lays the
    file out without writing it (its tensors' bytes kept by reference: they must not change until this
    returns, as the snapshot engine's buffers do not; its zip records without their CRC-32, which
    torch.load does not need: `_ZipCrcOff`), then `writers` threads write its pieces in place
    (pwrite) while this thread computes its CRC-32 in order and the pages are written back behind
    them; fsynced and recorded like `save_torch_file`. Returns the file's size. `min_kept`: the
    smallest write kept by reference; `chunk`: the size of the pieces the writers take (several
    writers only pay where the storage takes one file's writes in parallel)."""
    path = pending.path(relpath)
    laid_out = lay_out(obj, str(path), min_kept)
    pieces = _pieces(laid_out.segments, chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with fsutil.flushing_behind(fd):
            jobs = [_spreaders.submit(_pwrite_all, fd, pieces[k::writers]) for k in range(writers)]
            crc = 0
            for _offset, data in laid_out.segments:
                crc = zlib.crc32(data, crc)
            wait(jobs)
            for job in jobs:
                job.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    pending.record(relpath, laid_out.size, crc)
    return laid_out.size
