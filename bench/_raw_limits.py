"""The raw limit the checkpoint benches compare against: one sequential write + fsync of host tensors."""
from __future__ import annotations

import os
import time
from pathlib import Path


def raw_write_seconds(tensors, directory: Path) -> float:
    """Writes the bytes of `tensors` (host tensors) to `directory/raw.bin` in 8 MiB writes, then fsyncs."""
    import torch

    started = time.perf_counter()
    fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos:pos + (8 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started
