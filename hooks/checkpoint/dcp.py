"""torch.distributed.checkpoint plug-ins: DCP writes straight into a pending checkpoint.

`StoreDcpWriter(pending)` is a `FileSystemWriter` (DCP's own file format, so `dcp.load` with
`StoreDcpReader`/`FileSystemReader` reads it) that:
- writes into `pending.dir` one file per writer thread (`thread_count`, DCP's
  `single_file_per_rank` layout: the same items in the same files at the same offsets as DCP's
  own writer), each item laid out by `torch.save` without copying its tensor's bytes or computing
  the zip records' CRC-32 (torchfile.lay_out: torch.load, and so dcp.load, needs none; the store's
  CRC-32 of each file verifies it), written front to back with direct I/O (`direct_file`: no
  page cache, a fraction of the CPU of a buffered write; buffered with the pages written back
  behind the writer where direct I/O is off or refused); DCP's own per-item path (a Python
  stream per tensor, the zip CRC computed) is what a writer given DCP's `_extensions` or
  another `serialization_format` still takes;
- checksums every file as it goes out and records it in the pending checkpoint, so no
  file is read back;
- ends with `pending.finish_rank(rank)` (non-coordinators after their data, the coordinator
  after `.metadata`), so when `dcp.save` / the `dcp.async_save` future returns, this rank's
  part is durable; the commit protocol (commit.py) then commits it;
- as the async stager (`dcp.async_save(..., storage_writer=writer)`), copies the state into
  CPU buffers that the store keeps across saves (allocated, memory-checked, once), so a
  save's stall is the copy only.
Use `async_checkpointer_type=THREAD` (the default): the writer holds the pending checkpoint's
lock and cannot move to another process.
`StoreDcpReader(info.dir)` reads a committed checkpoint of either store (the object store's `dir`
is where `resolve` downloaded it). Any `PendingCheckpoint` (types.py) takes the writer: the stores
host no format plug-in (their `dcp_writer` / `dcp_reader` are deprecated names for these two).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (DEFAULT_SUFFIX, FileSystem, FileSystemReader, FileSystemWriter,
                                                     SerializationFormat, _split_by_size_and_type, _StorageInfo)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from . import fsutil
from .direct_file import sequential_file
from .torchfile import lay_out
from .types import CheckpointInfo, PendingCheckpoint

_file_writers = ThreadPoolExecutor(16, thread_name_prefix="spotguard-dcp-file")

log = logging.getLogger(__name__)


class _ChecksumStream(fsutil.ChecksumWriter):
    """A checksumming write stream (fsutil.ChecksumWriter) that fsyncs its file when closed."""

    def close(self) -> None:
        """Flushes, fsyncs and closes the file (DCP closes streams itself, before the context ends)."""
        if not self.raw.closed:
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.raw.close()
        super().close()


class _RecordingFileSystem(FileSystem):
    """DCP's FileSystem, recording every file it writes under `pending.dir` with size and CRC-32."""

    def __init__(self, pending: PendingCheckpoint):
        super().__init__()
        self.pending = pending

    def _rel(self, path) -> str:
        return Path(path).relative_to(self.pending.dir).as_posix()

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            stream = _ChecksumStream(raw)
            behind = os.dup(raw.fileno())  # DCP fsyncs and closes the stream itself, inside the block
            try:
                with fsutil.flushing_behind(behind):  # the write-back runs while DCP writes
                    yield stream
            finally:
                os.close(behind)
            stream.close()  # fsyncs: durability does not depend on DCP's sync_files setting
        self.pending.record(self._rel(path), stream.size, stream.crc)

    def rename(self, path, new_path) -> None:
        entry = self.pending.files.get(self._rel(path))
        super().rename(path, new_path)
        if entry is not None:
            self.pending.forget(self._rel(path))
            self.pending.record(self._rel(new_path), entry["size"], int(entry["crc32"], 16))

    def rm_file(self, path) -> None:
        super().rm_file(path)
        self.pending.forget(self._rel(path))


class StoreDcpWriter(FileSystemWriter):
    """A DCP StorageWriter (and async stager) that saves into a pending checkpoint of the store."""

    def __init__(self, pending: PendingCheckpoint, *, thread_count: int = 4, finish_rank: bool = True,
                 cache_staged_state_dict: bool = False, **options: Any):
        super().__init__(pending.dir, single_file_per_rank=True, sync_files=True, thread_count=thread_count,
                         overwrite=True, cache_staged_state_dict=cache_staged_state_dict, **options)
        self.pending = pending
        self.fs = _RecordingFileSystem(pending)
        self._finish_rank = finish_rank
        self._is_coordinator = False

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id and Path(checkpoint_id) != self.pending.dir:
            raise ValueError(f"this writer saves into {self.pending.dir}; make a new one for {checkpoint_id}")
        super().reset(None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator
        if self.rank is None:
            self.rank = kwargs.get("rank", 0 if is_coordinator else None)

    def _my_rank(self) -> int:
        if self.rank is not None:
            return int(self.rank)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return 0

    def write_data(self, plan, planner):
        future = self._write_files(plan, planner) if self._lays_out() else super().write_data(plan, planner)
        if self._finish_rank and not self._is_coordinator:
            future.wait()  # a torch.futures.Future; DCP's writer completes it before returning
            self.pending.finish_rank(self._my_rank())
        return future

    def _lays_out(self) -> bool:
        return (self.single_file_per_rank and not self.transforms.extensions
                and self.serialization_format == SerializationFormat.TORCH_SAVE)

    def _write_files(self, plan, planner) -> torch.futures.Future:
        """DCP's `single_file_per_rank` files, one per bucket of `_split_by_size_and_type` (as DCP's
        writer), written at once by the file writers; a failure raises once every file ended."""
        prefix = plan.storage_data.prefix
        buckets = _split_by_size_and_type(self.thread_count, plan.items)
        jobs = [_file_writers.submit(self._write_file, f"{prefix}{k}{DEFAULT_SUFFIX}", bucket, planner)
                for k, bucket in enumerate(buckets)]
        wait(jobs)
        results: list[WriteResult] = []
        for job in jobs:
            results += job.result()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner) -> list[WriteResult]:
        """One file: its byte items, then its tensors (DCP's order), each where DCP puts it; fsynced and
        recorded (size, CRC-32 as written)."""
        results: list[WriteResult] = []
        offset = 0
        with sequential_file(self.pending.path(name)) as file:
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + \
                      [i for i in items if i.type != WriteItemType.BYTE_IO]
            for item in ordered:
                length = 0
                _owner, segments = _item_bytes(planner, item, name)
                for data in segments:
                    length += file.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                offset += length
        crc = file.crc
        self.pending.record(name, offset, crc)
        return results

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        if self._finish_rank:
            self.pending.finish_rank(self._my_rank())


def _item_bytes(planner, item: WriteItem, name: str) -> tuple[Any, list[Any]]:
    """The bytes DCP's writer puts in the file for `item`: a byte item's buffer, or `torch.save` of
    the tensor (detached, on the CPU, cut to its own storage as DCP's loader does) laid out; with
    the object they lie in, which the caller keeps until they are written."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        return data, [data.getbuffer()]
    tensor = data.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor, [segment for _offset, segment in lay_out(tensor, name).segments]


class StoreDcpReader(FileSystemReader):
    """DCP's FileSystemReader over a committed checkpoint directory (verify it with the store first)."""

    def __init__(self, path: os.PathLike | str, **options: Any):
        super().__init__(path, **options)


def deprecated_writer(pending: PendingCheckpoint, **options: Any) -> StoreDcpWriter:
    """What the deprecated `store.dcp_writer(pending)` gives, with its DeprecationWarning."""
    warnings.warn("store.dcp_writer(pending) is deprecated: use "
                  "spotguard.hooks.checkpoint.dcp.StoreDcpWriter(pending)", DeprecationWarning, stacklevel=3)
    return StoreDcpWriter(pending, **options)


def deprecated_reader(info: CheckpointInfo, **options: Any) -> StoreDcpReader:
    """What the deprecated `store.dcp_reader(info)` gives, with its DeprecationWarning."""
    warnings.warn("store.dcp_reader(info) is deprecated: use "
                  "spotguard.hooks.checkpoint.dcp.StoreDcpReader(info.dir)", DeprecationWarning, stacklevel=3)
    return StoreDcpReader(info.dir, **options)
