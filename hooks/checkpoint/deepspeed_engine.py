"""A DeepSpeed CheckpointEngine that makes `engine.save_checkpoint` save through the store.

    ds_engine.checkpoint_engine = store.deepspeed_engine()        # once, after deepspeed.initialize
    ds_engine.checkpoint_engine.prepare(metadata={"step": 120, "reason": "notice", "notice_id": ...})
    ds_engine.save_checkpoint(str(store.root), tag="step-120", save_latest=False)
    # -> committed: store.latest().tag == "step-120"
    ds_engine.load_checkpoint(str(info.dir.parent), tag=info.tag)   # after store.resolve()

What it does with DeepSpeed's calls:
- `create(info)`: `store.begin(tag)`; every path DeepSpeed names under `<save_dir>/<tag>/` is
  redirected into the pending dir (`save_dir` should be the store root);
- `save(state, path)`: with fast=True (default) the tensors' raw bytes go out from their own
  memory in parallel data files plus a JSON index at `path` (rawformat.py) - no pickle of
  tensor data, no clone (`preserves_storage_sharing()` is False); the write runs in the
  background while DeepSpeed assembles the next file. fast=False: torch.save into the pending dir;
- `commit(info)`: waits for the writes, `finish_rank`, barrier, rank 0 `store.commit(...)`
  with the metadata given to `prepare`; DeepSpeed's own barrier follows, so save_checkpoint
  returns on every rank only once the checkpoint is committed;
- `load(path)`: reads the raw format, or falls back to torch.load for files DeepSpeed wrote
  itself, so older checkpoints still load.
Pass `save_latest=False`: the store maintains `latest` atomically; DeepSpeed's own write of it
is not atomic. Tools that torch.load the files directly (zero_to_fp32, ds_to_universal) need
fast=False checkpoints.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from spotguard.config import positive_int

from . import rawformat
from .layout import flatten
from .store import CheckpointInfo, CheckpointStore, PendingCheckpoint

log = logging.getLogger(__name__)


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class StoreCheckpointEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine writing into `store`'s pending dirs and committing on `commit`."""

    def __init__(self, store: CheckpointStore, *, fast: bool = True, files: int = 4, auto_commit: bool = True,
                 config_params: Any = None):
        super().__init__(config_params)
        self.name = "SpotguardStoreCheckpointEngine"
        self.store = store
        self.fast = fast
        self.files = positive_int("files", files)
        self.auto_commit = auto_commit
        self._metadata: dict[str, Any] = {}
        self._pending: PendingCheckpoint | None = None
        self._base: Path | None = None
        self._writes: list[Future] = []
        self._file_pool = ThreadPoolExecutor(self.files, thread_name_prefix="spotguard-ds-write")
        self._blob_pool = ThreadPoolExecutor(2, thread_name_prefix="spotguard-ds-blob")
        self.last_commit: CheckpointInfo | None = None

    def prepare(self, metadata: Mapping[str, Any] | None = None) -> None:
        """Sets the manifest metadata (step, reason, notice_id, ...) for the next save_checkpoint."""
        self._metadata = dict(metadata or {})

    # ---- DeepSpeed's interface ------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if self._pending is not None:
            self._abandon()
        self._pending = self.store.begin(str(info.tag))
        self._base = Path(info.save_dir).absolute() / str(info.tag)

    def _redirect(self, path: str | os.PathLike) -> Path | None:
        if self._pending is None or self._base is None:
            return None
        try:
            rel = Path(path).absolute().relative_to(self._base)
        except ValueError:
            return None
        return self._pending.dir / rel if rel.parts else self._pending.dir

    def makedirs(self, path, exist_ok: bool = False) -> None:
        target = self._redirect(path)
        os.makedirs(target if target is not None else path, exist_ok=exist_ok or target is not None)

    def save(self, state_dict, path: str) -> None:
        target, pending = self._redirect(path), self._pending
        if target is None or pending is None:  # (_redirect gives None while no checkpoint is pending)
            raise ValueError(f"{path} is outside the checkpoint being saved ({self._base}); call save_checkpoint "
                             "with save_dir = the store root")
        rel = target.relative_to(pending.dir).as_posix()
        if not self.fast:
            torch.save(state_dict, target)
            pending.adopt(rel)
            return
        skeleton, tensors = flatten(state_dict)
        self._writes.append(self._blob_pool.submit(
            rawformat.write_blob, pending, rel, skeleton, tensors, self.files, self._file_pool,
            {"source": "deepspeed"}))

    def load(self, path: str, map_location=None):
        if rawformat.is_raw_index(Path(path)):
            state, _ = rawformat.load_blob(Path(path))
            if map_location is not None and not callable(map_location) and torch.device(map_location).type != "cpu":
                state = _to_device(state, torch.device(map_location))
            return state
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        pending, writes = self._pending, self._writes
        self._writes = []
        if pending is None:
            return False
        rank, world = _dist_rank_world()
        try:
            for write in writes:
                write.result()
            pending.finish_rank(rank)
        except BaseException:
            self._abandon(pending)
            raise
        if self.auto_commit:
            if world > 1:
                torch.distributed.barrier()
            if rank == 0:
                self.last_commit = self.store.commit(str(info.tag), world_size=world, metadata=self._metadata)
            pending.close()
        self._pending = None
        self._base = None
        return True

    def preserves_storage_sharing(self) -> bool:
        return not self.fast  # raw writes read tensor memory directly: no clone needed

    def cleanup(self) -> None:
        self._file_pool.shutdown(wait=True)
        self._blob_pool.shutdown(wait=True)

    # ---- helpers -----------------------------------------------------------------------------
    def _abandon(self, pending: PendingCheckpoint | None = None) -> None:
        pending = pending or self._pending
        for write in self._writes:
            write.exception()
        self._writes = []
        if pending is not None:
            pending.close()
        self._pending = None
        self._base = None


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj
