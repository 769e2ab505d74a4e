"""Durable `torch.save` files inside a pending checkpoint.

Contract: `save_torch_file(pending, relpath, obj)` writes `obj` with `torch.save` straight to
its file in the pending directory (no serialized copy in memory) through a stream that keeps the
CRC-32 of every byte as it goes out (fsutil.ChecksumWriter: the file is never read back), while a
thread writes the file's pages back behind it (`fsutil.flushing_behind`: the write and the flush
overlap); then fsyncs it and records it in the pending checkpoint. It returns only once the file
is durable; the format is plain `torch.save`, so `torch.load` reads it. Several calls may run at
once in threads (torchshards.py writes a state's shards so).
"""
from __future__ import annotations

import os
from typing import IO, Any, cast

import torch

from . import fsutil
from .store import PendingCheckpoint


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
