"""Durable `torch.save` files inside a pending checkpoint.

Contract: `save_torch_file(pending, relpath, obj)` writes `obj` with `torch.save` straight to
its file in the pending directory (torch's own file writer: no serialized copy in memory), then
fsyncs it while a second thread reads it back from the page cache for its CRC-32 (the checksum
overlaps the flush to disk), and records the file in the pending checkpoint. It returns only once
the file is durable; the format is plain `torch.save`, so `torch.load` reads it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import fsutil
from .store import PendingCheckpoint

_checksums = ThreadPoolExecutor(2, thread_name_prefix="spotguard-crc")


def save_torch_file(pending: PendingCheckpoint, relpath: str, obj: Any) -> int:
    """Writes, fsyncs and records `relpath`; returns its size (see the module docstring)."""
    path = pending.path(relpath)
    torch.save(obj, str(path))
    checksum = _checksums.submit(fsutil.file_crc32, path)
    fsutil.fsync_path(path)
    size, crc = checksum.result()
    pending.record(relpath, size, crc)
    return size
