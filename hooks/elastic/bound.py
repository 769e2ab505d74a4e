"""How long a change may wait for a peer: every group a change uses is bounded by the re-form
timeout until the change commits, so a peer that dies at any point of it costs at most that
long before the fallback (torch's default is 30 minutes per operation).

Contract:
- `bound_groups(seconds)`: every live process group of this process, and every group created
  from now on (torch's default timeout for new groups: the adapter's and the Guard's own, a
  device mesh's made in `build()`, ...), waits at most `seconds` per operation, until
  `release_groups()`. A formation (`Rendezvous.form`) bounds, a change's start bounds the old
  groups too.
- `release_groups()`: torch's default timeout again, for the live groups and for new ones (what
  training and saves run with). Called once the change committed (the survivors' vote, the
  joiner's `resume()`, a starting rank's Guard), or before a fallback's save. Idempotent.
- `bounded()`: whether a bound is in force (tests, logs).
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from spotguard.hooks.elastic.torch_private import set_live_group_timeouts

log = logging.getLogger("spotguard.hooks.elastic")

_torch_default: timedelta | None = None  # torch's own default, kept while a bound replaces it


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


def _set_live_groups(timeout: timedelta) -> None:
    set_live_group_timeouts(timeout)


def bound_groups(seconds: float) -> None:
    """See the module docstring."""
    global _torch_default
    c10d = _c10d()
    if _torch_default is None:
        _torch_default = c10d.default_pg_timeout
    bound = timedelta(seconds=seconds)
    c10d.default_pg_timeout = bound  # read by torch whenever a group is made without a timeout
    _set_live_groups(bound)


def release_groups() -> None:
    """See the module docstring."""
    global _torch_default
    if _torch_default is None:
        return
    default, _torch_default = _torch_default, None
    _c10d().default_pg_timeout = default
    _set_live_groups(default)


def bounded() -> bool:
    return _torch_default is not None
