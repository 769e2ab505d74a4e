"""Caches torch keeps across process groups that a re-form must drop.

DTensor caches sharding propagation and redistribution plans keyed by the device mesh's hash,
which covers the mesh's shape and dimension names but not this process's rank in it. After a
re-form a process can hold another rank of an equally shaped mesh (rank 2 of 3 before a shrink,
rank 1 of 3 after the grow that follows), and a cached plan would slice its shard at the old
coordinate. `forget_mesh_caches()` clears them; it is cheap (the caches refill on first use).
The private torch calls live in `torch_private`.
"""
from __future__ import annotations

from spotguard.hooks.elastic.torch_private import forget_mesh_caches

__all__ = ["forget_mesh_caches"]
