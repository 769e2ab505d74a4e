"""torch.distributed.checkpoint plug-ins: DCP writes straight into a pending checkpoint.

`StoreDcpWriter(pending)` is a `FileSystemWriter` (DCP's own file format, so `dcp.load` with
`StoreDcpReader`/`FileSystemReader` reads it) that:
- writes into `pending.dir` with several writer threads and fsync on, each file's pages written
  back while DCP still writes it (`fsutil.flushing_behind`), so the fsync finds little left;
- checksums every file as it streams out and records it in the pending checkpoint, so no
  file is read back;
- ends with `pending.finish_rank(rank)` (non-coordinators after their data, the coordinator
  after `.metadata`), so when `dcp.save` / the `dcp.async_save` future returns, this rank's
  part is durable; the caller barriers and rank 0 calls `store.commit`;
- as the async stager (`dcp.async_save(..., storage_writer=writer)`), copies the state into
  CPU buffers that the store keeps across saves (allocated, memory-checked, once), so a
  save's stall is the copy only.
Use `async_checkpointer_type=THREAD` (the default): the writer holds the pending checkpoint's
lock and cannot move to another process.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter

from . import fsutil
from .store import PendingCheckpoint

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
        future = super().write_data(plan, planner)
        if self._finish_rank and not self._is_coordinator:
            future.wait()  # a torch.futures.Future; DCP's writer completes it before returning
            self.pending.finish_rank(self._my_rank())
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        if self._finish_rank:
            self.pending.finish_rank(self._my_rank())


class StoreDcpReader(FileSystemReader):
    """DCP's FileSystemReader over a committed checkpoint directory (verify it with the store first)."""

    def __init__(self, path: os.PathLike | str, **options: Any):
        super().__init__(path, **options)
