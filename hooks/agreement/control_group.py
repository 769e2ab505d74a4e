"""The gloo groups spotguard makes for each formation of the default process group, the only
groups it makes: user code never creates them, and their order never depends on whether the
adapter or the Guard is made first.

Contract:
- `control_groups()` -> `ControlGroups | None`: None when torch.distributed is not initialised
  or the default group has one rank. Otherwise the groups of the current default group: the
  first call after a formation makes them (collective over every rank of the default group, in
  the same order on every rank: the first of the adapter and the Guard to be made, or the
  formation itself), every later call returns the same ones until the default group is formed
  again. A user who calls torch's `init_process_group` gets them on first use; spotguard's
  formations (`hooks.elastic.init_process_group`, every in-place re-form) call it right after
  the default group forms, so survivors and joiners make them at the
  same point whatever their code does next.
- `control`: the Guard's group (its agreement, and every collective of an in-place change).
- `checkpoint`: the adapters' (the commit protocol, DCP's collectives). A checkpoint is
  persisted on the snapshot engine's writer thread while training goes on, so its collectives
  run beside the Guard's agreement of each step: on one gloo group, two threads issuing
  collectives in different orders on different ranks would pair the wrong operations. Both are
  gloo whatever the default group's backend (control traffic never rides on NCCL).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ControlGroups:
    """The gloo groups of one formation (see the module docstring)."""

    control: Any
    checkpoint: Any


_made: tuple[Any, ControlGroups] | None = None  # (the default group they were made for, the groups)


def _default_group() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD


def control_groups() -> ControlGroups | None:
    """See the module docstring."""
    world = _default_group()
    if world is None:
        return None
    if _made is not None and _made[0] is world:
        return _made[1]
    return _make(world)


def _make(world: Any) -> ControlGroups:
    global _made
    import torch.distributed as dist

    groups = ControlGroups(dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    _made = (world, groups)
    return groups
