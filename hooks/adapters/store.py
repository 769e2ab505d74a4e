"""The checkpoint store the adapters save through (`spotguard.hooks.checkpoint`), re-exported so
adapter code names one place."""
from __future__ import annotations

from spotguard.hooks.checkpoint import CheckpointCorrupt, CheckpointInfo, CheckpointStore, open_store

__all__ = ["CheckpointCorrupt", "CheckpointInfo", "CheckpointStore", "open_store"]
