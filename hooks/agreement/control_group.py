"""The gloo groups spotguard makes for each formation of the default process group, the only
groups it makes: user code never creates them, and their order never depends on whether the
adapter or the Guard is made first.

Contract:
- `make_control_groups()` -> `ControlGroups`: the two groups of the current default group
  (collective over every rank of it, in the same order on every rank). The process's
  `group_session.GroupSession` makes them once per formation and keeps them: spotguard's
  formations (`hooks.elastic.init_process_group`, every in-place re-form) right after the default
  group forms, so survivors and joiners make them at the same point whatever their code does
  next; a job that called torch's `init_process_group` on first use (the first of the adapter
  and the Guard to be made).
- `control_groups()` -> `ControlGroups | None`: the current formation's (the process session's
  `groups()`): None when torch.distributed is not initialised or the default group has one rank.
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


def make_control_groups() -> ControlGroups:
    """See the module docstring."""
    import torch.distributed as dist

    return ControlGroups(dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))


def control_groups() -> ControlGroups | None:
    """See the module docstring."""
    from spotguard.hooks.group_session import process_session

    return process_session().groups()
