"""The checkpoint store and the snapshot engine (see store.py and engine.py for the contracts).

Public API (agreed with the Guard and adapters):
    open_store(location, keep_last=3): a CheckpointStore for a directory, an ObjectCheckpointStore
    (objectstore/, local disk first, then S3) for `s3://bucket/prefix`; both offer:
    CheckpointStore(root, keep_last=3) -> begin(tag) / commit(tag, world_size, metadata)
    / latest() / resolve(verify=True) / dcp_writer(pending) / dcp_reader(info)
    / derived(kind) (copies made from checkpoints, removed with them: derived.py)
    CheckpointInfo, CheckpointCorrupt, PendingCheckpoint, CommitError
    SnapshotEngine (engine.py: snapshot into buffers allocated once, persist in the background;
    every adapter saves through it), check_host_memory, InsufficientHostMemory
The DCP plug-ins live in dcp.py and import torch.distributed.checkpoint only when used.
`FastCheckpointer`, `load_rank` and `store.deepspeed_engine()` were replaced by the engine under
the adapters: the names still import and say which call replaces them.
"""
from typing import Any

from .memory import InsufficientHostMemory, check_host_memory
from .store import CheckpointCorrupt, CheckpointInfo, CheckpointStore, CommitError, PendingCheckpoint, open_store

__all__ = [
    "CheckpointCorrupt", "CheckpointInfo", "CheckpointStore", "CommitError", "InsufficientHostMemory",
    "PendingCheckpoint", "check_host_memory", "open_store",
]

REPLACED = {
    "FastCheckpointer": "the adapters' own snapshot engine: PlainTorchAdapter / TorchDCPAdapter / DeepSpeedAdapter "
                        "(model, optimizer, checkpoint_dir=...).save(step) or .save_async(step); "
                        "spotguard.hooks.checkpoint.engine.SnapshotEngine underneath",
    "Snapshot": "spotguard.hooks.checkpoint.engine.Snapshot",
    "load_rank": "the adapter's resume() (checkpoints of the removed raw format do not load: see the README)",
}


def __getattr__(name: str) -> Any:
    if name == "SnapshotEngine":
        from .engine import SnapshotEngine

        return SnapshotEngine
    if name in REPLACED:
        raise ImportError(f"spotguard.hooks.checkpoint.{name} was removed (issue 21): use {REPLACED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
