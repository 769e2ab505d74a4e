"""The checkpoint store and the snapshot engine the adapters save through (`spotguard.hooks.checkpoint`),
re-exported so adapter code names one place."""
from __future__ import annotations

from spotguard.hooks.checkpoint import (CheckpointCorrupt, CheckpointFailed, CheckpointInfo, CheckpointStore,
                                        PendingCheckpoint, Store, open_store)
from spotguard.hooks.checkpoint.engine import PartTimes, Snapshot, SnapshotEngine

__all__ = ["CheckpointCorrupt", "CheckpointFailed", "CheckpointInfo", "CheckpointStore", "PartTimes",
           "PendingCheckpoint", "Snapshot", "SnapshotEngine", "Store", "open_store"]
