"""Durable `torch.save` files inside a pending checkpoint.

Contract: `save_torch_file(pending, relpath, obj)` writes `obj` with `torch.save` straight to
its file in the pending directory (no serialized copy in memory) while a thread writes the
file's pages back behind it (`fsutil.flushing_behind`: the write and the flush overlap), then
fsyncs it while a second thread reads it back from the page cache for its CRC-32, and records
the file in the pending checkpoint. It returns only once
the file is durable; the format is plain `torch.save`, so `torch.load` reads it.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import fsutil
from .store import PendingCheckpoint

_checksums = ThreadPoolExecutor(2, thread_name_prefix="spotguard-crc")


def save_torch_file(pending: PendingCheckpoint, relpath: str, obj: Any) -> int:
    """Writes, fsyncs and records `relpath`; returns its size (see the module docstring)."""
    path = pending.path(relpath)
    with open(path, "wb") as file:
        with fsutil.flushing_behind(file.fileno()):
            torch.save(obj, file)
            file.flush()
        checksum = _checksums.submit(fsutil.file_crc32, path)
        os.fsync(file.fileno())
    size, crc = checksum.result()
    pending.record(relpath, size, crc)
    return size
