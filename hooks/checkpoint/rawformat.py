"""The on-disk raw tensor format: data files of tensor bytes plus a small JSON index.

One "blob" is the tensors of one state dict laid out back to back in a virtual byte arena
(each tensor at a 64-byte aligned offset), cut into `len(files)` data files named
`<index>.data<k>`; concatenating the data files in order gives the arena back. The index file
(`<index>`) is JSON: format/version, the skeleton (layout.py), and per tensor its name,
dtype, shape, offset and byte count, plus each data file's size and CRC-32. Loading reads the
files into one buffer and returns tensors that are views into it: no pickle for tensor data.

Writers here call `write_pieces`, which writes and fsyncs one data file from a list of
buffers, computing the CRC-32 on the fly (both release the GIL, so several run in parallel).
"""
from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch

from . import fsutil
from .layout import dtype_from_name, dtype_name, unflatten

FORMAT = "spotguard-raw"
VERSION = 1
ALIGN = 64
FILE_ALIGN = 4096


class RawFormatError(ValueError):
    """An index or data file is not a valid spotguard-raw blob (or does not match its index)."""


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_offsets(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorSlot], int]:
    """Aligned arena offsets for the tensors; returns (slots, total bytes)."""
    slots, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        offset = -(-offset // ALIGN) * ALIGN
        slots.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += nbytes
    return slots, offset


def plan_files(total: int, count: int) -> list[tuple[int, int]]:
    """Cuts [0, total) into up to `count` page-aligned ranges of near-equal size (at least one)."""
    if total <= 0:
        return [(0, 0)]
    count = max(1, min(count, -(-total // (1 << 20))))  # no file under ~1 MiB
    per_file = -(-total // count)
    step = -(-per_file // FILE_ALIGN) * FILE_ALIGN
    return [(start, min(total, start + step)) for start in range(0, total, step)]


def data_name(index_relpath: str, k: int) -> str:
    return f"{index_relpath}.data{k}"


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (any dtype, including bfloat16)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return flat.numpy().data


def write_pieces(path: Path, pieces: Sequence[memoryview]) -> tuple[int, int]:
    """Writes the buffers in order to a new file, fsyncs it; returns (size, crc32)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size, crc = 0, 0
        for piece in pieces:
            n, crc = fsutil.write_fd_all(fd, piece, crc)
            size += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc


def build_index(skeleton: Any, slots: Sequence[TensorSlot], total: int,
                files: Sequence[tuple[str, int, int]], meta: dict[str, Any] | None = None) -> bytes:
    """The index JSON; `files` is [(relative name, size, crc32)] in arena order."""
    return json.dumps({
        "format": FORMAT, "v": VERSION, "total": total, "meta": meta or {},
        "files": [{"name": Path(n).name, "size": s, "crc32": f"{c:08x}"} for n, s, c in files],
        "tensors": [{"name": s.name, "dtype": dtype_name(s.dtype), "shape": list(s.shape),
                     "offset": s.offset, "nbytes": s.nbytes} for s in slots],
        "skeleton": skeleton,
    }, separators=(",", ":")).encode()


def is_raw_index(path: Path) -> bool:
    """True when `path` starts like a spotguard-raw index (cheap sniff, no full parse)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(b'{"format":"' + FORMAT.encode())


def read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(Path(path).read_bytes())
    except ValueError as exc:
        raise RawFormatError(f"{path}: index is not JSON: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("v") != VERSION:
        raise RawFormatError(f"{path}: not a {FORMAT} v{VERSION} index")
    return index


def load_blob(index_path: Path, *, verify: bool = False, threads: int = 4) -> tuple[Any, dict[str, Any]]:
    """(state, meta) of the blob indexed by `index_path`; tensors are views of one fresh buffer.

    With verify=True each data file's CRC-32 is checked against the index (RawFormatError).
    """
    index_path = Path(index_path)
    index = read_index(index_path)
    total = int(index["total"])
    arena = torch.empty(max(total, 1), dtype=torch.uint8)
    view = arena.numpy().data
    ranges, start = [], 0
    for f in index["files"]:
        ranges.append((index_path.parent / f["name"], start, int(f["size"]), f["crc32"]))
        start += int(f["size"])
    if start != total:
        raise RawFormatError(f"{index_path}: data files hold {start} bytes, index says {total}")

    def read_one(item) -> None:
        path, offset, size, crc_hex = item
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < size:
                n = f.readinto(view[offset + got: offset + size])
                if not n:
                    raise RawFormatError(f"{path}: {got} bytes, index says {size}")
                got += n
            if f.read(1):
                raise RawFormatError(f"{path}: longer than the {size} bytes the index says")
        if verify and f"{zlib.crc32(view[offset:offset + size]):08x}" != crc_hex:
            raise RawFormatError(f"{path}: checksum mismatch")

    if len(ranges) > 1:
        with ThreadPoolExecutor(min(threads, len(ranges))) as pool:
            list(pool.map(read_one, ranges))
    else:
        for item in ranges:
            read_one(item)
    tensors = []
    for t in index["tensors"]:
        dtype = dtype_from_name(t["dtype"])
        offset, nbytes, shape = int(t["offset"]), int(t["nbytes"]), tuple(t["shape"])
        if offset + nbytes > total:
            raise RawFormatError(f"{index_path}: tensor {t['name']} lies outside the data")
        raw = arena[offset:offset + nbytes]
        tensors.append(raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype))
    return unflatten(index["skeleton"], tensors), index.get("meta", {})


_ZEROS = memoryview(bytes(ALIGN))


def _file_pieces(slots: Sequence[TensorSlot], buffers: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The buffers (and zero padding) covering arena bytes [start, end), in order."""
    pieces, cursor = [], start
    for slot, buf in zip(slots, buffers):
        lo, hi = max(slot.offset, start), min(slot.offset + slot.nbytes, end)
        if hi <= lo:
            continue
        while cursor < lo:  # alignment padding before this tensor
            gap = min(lo - cursor, ALIGN)
            pieces.append(_ZEROS[:gap])
            cursor += gap
        pieces.append(buf[lo - slot.offset:hi - slot.offset])
        cursor = hi
    while cursor < end:
        gap = min(end - cursor, ALIGN)
        pieces.append(_ZEROS[:gap])
        cursor += gap
    return pieces


def write_blob(pending, index_relpath: str, skeleton: Any, tensors: Sequence[tuple[str, torch.Tensor]],
               files: int, pool: ThreadPoolExecutor, meta: dict[str, Any] | None = None) -> int:
    """Writes the tensors' bytes straight from their memory (no staging copy) plus the index.

    Tensors not on the CPU or not contiguous are copied first. Data files go out in parallel
    on `pool`; every file is fsynced and recorded in `pending`. Returns the bytes of tensor data.
    """
    host = [(n, t.detach().cpu().contiguous() if (t.device.type != "cpu" or not t.is_contiguous()) else t.detach())
            for n, t in tensors]
    slots, total = plan_offsets(host)
    buffers = [as_bytes(t) for _, t in host]
    bounds = plan_files(total, files)
    names = [data_name(index_relpath, k) for k in range(len(bounds))]
    futures = [pool.submit(write_pieces, pending.path(name), _file_pieces(slots, buffers, a, b))
               for name, (a, b) in zip(names, bounds)]
    results = [f.result() for f in futures]
    for name, (size, crc) in zip(names, results):
        pending.record(name, size, crc)
    pending.write_bytes(index_relpath, build_index(skeleton, slots, total,
                                                   [(n, s, c) for n, (s, c) in zip(names, results)], meta))
    return total
