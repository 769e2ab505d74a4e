"""Caches torch keeps across process groups that a re-form must drop.

DTensor caches sharding propagation and redistribution plans keyed by the device mesh's hash,
which covers the mesh's shape and dimension names but not this process's rank in it. After a
re-form a process can hold another rank of an equally shaped mesh (rank 2 of 3 before a shrink,
rank 1 of 3 after the grow that follows), and a cached plan would slice its shard at the old
coordinate. `forget_mesh_caches()` clears them; it is cheap (the caches refill on first use).
"""
from __future__ import annotations

import logging

log = logging.getLogger("spotguard.hooks.elastic")


def forget_mesh_caches() -> None:
    """Clears DTensor's sharding caches (Python and the C++ fast path) and its redistribution
    plans; nothing when DTensor is absent."""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()
    clear_plans = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_plans is not None:
        clear_plans()
