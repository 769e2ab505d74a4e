"""The checkpoint store and its fast path (see store.py and fastpath.py for the contracts).

Public API (agreed with the Guard and adapters):
    open_store(location, keep_last=3): a CheckpointStore for a directory, an ObjectCheckpointStore
    (objectstore/, local disk first, then S3) for `s3://bucket/prefix`; both offer:
    CheckpointStore(root, keep_last=3) -> begin(tag) / commit(tag, world_size, metadata)
    / latest() / resolve(verify=True) / dcp_writer(pending) / dcp_reader(info) / deepspeed_engine()
    / derived(kind) (copies made from checkpoints, removed with them: derived.py)
    CheckpointInfo, CheckpointCorrupt, PendingCheckpoint, CommitError
    FastCheckpointer (snapshot into preallocated buffers, persist in the background), load_rank
    check_host_memory, InsufficientHostMemory
The DCP and DeepSpeed plug-ins live in dcp.py and deepspeed_engine.py and import their
frameworks only when used.
"""
from .fastpath import FastCheckpointer, Snapshot, load_rank
from .memory import InsufficientHostMemory, check_host_memory
from .store import CheckpointCorrupt, CheckpointInfo, CheckpointStore, CommitError, PendingCheckpoint, open_store

__all__ = [
    "CheckpointCorrupt", "CheckpointInfo", "CheckpointStore", "CommitError", "FastCheckpointer",
    "InsufficientHostMemory", "PendingCheckpoint", "Snapshot", "check_host_memory", "load_rank", "open_store",
]
