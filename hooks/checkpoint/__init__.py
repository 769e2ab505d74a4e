"""The checkpoint store and the snapshot engine (see store.py and engine.py for the contracts).

Public API (agreed with the Guard and adapters):
    open_store(location, keep_last=3) (factory.py): a CheckpointStore for a directory, an
    ObjectCheckpointStore (objectstore/, local disk first, then S3) for `s3://bucket/prefix`; both
    implement `Store` (types.py): begin(tag, attempt) / commit(tag, world_size, metadata)
    / latest() / resolve(verify=True) / derived(kind) (copies made from checkpoints, removed with
    them: derived.py) ...
    CheckpointInfo, CheckpointCorrupt, PendingCheckpoint, CommitError, CheckpointFailed (types.py)
    CollectiveCommit (commit.py): the commit protocol across ranks
    SnapshotEngine (engine.py: snapshot into buffers allocated once, persist in the background;
    every adapter saves through it), check_host_memory, InsufficientHostMemory
The layers, lowest first: a module imports only modules of the rows below it, or those left of a `<`
on its row (import-linter checks that there is no cycle and that types.py is a leaf):
    types.py: the vocabulary (CheckpointInfo, PendingCheckpoint, Store, the errors)
    fsutil, manifest, locks, memory: helpers
    pending, verify, derived, recovery, removal, buffers < engine; the format writers, which
        write into any PendingCheckpoint: torchfile < torchshards, dcp (which loads
        torch.distributed.checkpoint: the package does not import it); commit (the protocol across ranks)
    store.py: CheckpointStore, a directory
    objectstore/: ObjectCheckpointStore, `s3://` with the disk store as its first tier
    factory.py: open_store
`FastCheckpointer`, `load_rank` and `store.deepspeed_engine()` were replaced by the engine under
the adapters: the names still import and say which call replaces them.
"""
from typing import Any

from .factory import open_store
from .memory import InsufficientHostMemory, check_host_memory
from .store import CheckpointStore
from .types import (CheckpointCorrupt, CheckpointFailed, CheckpointInfo, CommitError, PendingCheckpoint, Store,
                    TieredStore)

__all__ = [
    "CheckpointCorrupt", "CheckpointFailed", "CheckpointInfo", "CheckpointStore", "CommitError",
    "InsufficientHostMemory", "PendingCheckpoint", "Store", "TieredStore", "check_host_memory", "open_store",
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
