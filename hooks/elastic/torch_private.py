"""Every private torch API spotguard reaches, in one place, checked against the torch it runs on.

Contract:
- `missing()`: the private names this torch lacks (empty on the versions tested: 2.7 to 2.13).
  Each function below degrades as it says when its name is missing, and logs that once.
- `set_live_group_timeouts(timeout)`: every live process group of this process waits at most
  `timeout` per operation (`c10d._set_pg_timeout`); nothing without a default group.
- `forget_mesh_caches()`: clears DTensor's sharding-propagation caches and redistribution plans
  (keyed by a mesh hash that ignores this process's rank in the mesh: see `caches`).
- `abort_groups()`: aborts every process group's communicators at once, never waiting on a peer
  (`c10d._abort_process_group`, torch >= 2.7; else each group's `abort()`), then forgets them.
The checkpoint engine's `_state_dict_utils` helpers (hooks/checkpoint/dcp.py) are listed here too.
"""
from __future__ import annotations

import importlib
import logging
import sys
from datetime import timedelta
from typing import Any

log = logging.getLogger("spotguard.hooks.elastic")

PRIVATE = (
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    ("torch.distributed.distributed_c10d", "_rank_not_in_group"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d", "_abort_process_group"),
    ("torch._C", "_clear_DTensor_sharding_propagator_cache"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed._state_dict_utils", "_copy_state_dict"),
)
_warned: set[str] = set()


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


PROP_CACHE = "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear"


def _python_prop_cache_clear(dtensor_api: Any) -> Any:
    """DTensor's Python sharding-propagation cache's `cache_clear`, or None (`PROP_CACHE`)."""
    found: Any = getattr(dtensor_api, "DTensor", None)
    for name in PROP_CACHE.split(".")[1:]:
        found = getattr(found, name, None)
    return found


def missing() -> list[str]:
    """`module.name` of every private API this torch lacks."""
    absent = [f"{m}.{n}" for m, n in PRIVATE if _lookup(m, n) is None]
    api = _lookup("torch.distributed.tensor", "_api")
    if api is not None and _python_prop_cache_clear(api) is None:
        absent.append(f"torch.distributed.tensor._api.{PROP_CACHE}")
    return absent


def _once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("this torch lacks %s: spotguard goes on without it", what)


def set_live_group_timeouts(timeout: timedelta) -> None:
    import torch.distributed.distributed_c10d as c10d

    if not c10d.is_initialized():
        return
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:
        _once("c10d._set_pg_timeout (live groups keep their timeout)")
        return
    for group in list(c10d._world.pg_map):
        try:
            if not c10d._rank_not_in_group(group):
                setter(timeout, group)
        except Exception as exc:  # a group being torn down: it waits on nothing any more
            log.debug("timeout of a process group not changed: %s", exc)


def forget_mesh_caches() -> None:
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is None:
        return  # DTensor never loaded in this process: nothing cached
    # torch.distributed.tensor.debug._clear_sharding_prop_cache does the same two calls, but
    # importing that module costs most of a second on a joiner's path.
    clear_python = _python_prop_cache_clear(api)
    clear_fast = _lookup("torch._C", "_clear_DTensor_sharding_propagator_cache")
    if clear_python is not None and clear_fast is not None:
        clear_python()
        clear_fast()
    else:
        clear_props = _lookup("torch.distributed.tensor.debug", "_clear_sharding_prop_cache")
        if clear_props is None:
            _once(f"{PROP_CACHE} (sharding plans may outlive a re-form)")
            return
        clear_props()
    clear_plans = _lookup("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")
    if clear_plans is not None:
        clear_plans()


def abort_groups() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort_all = getattr(c10d, "_abort_process_group", None)
    try:
        if abort_all is not None:
            abort_all()  # every group at once: no one-by-one abort deadlock
        else:
            _once("c10d._abort_process_group (aborting group by group)")
            for group in list(c10d._world.pg_map):
                group.abort()
    except Exception as exc:  # aborting is best effort: the groups are forgotten anyway
        log.warning("aborting the process groups: %s", exc)
    try:
        dist.destroy_process_group()  # after the abort nothing is left to flush: no wait on a peer
    except Exception as exc:
        log.debug("forgetting the aborted groups: %s", exc)
