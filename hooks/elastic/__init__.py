"""Membership changes in place: survivors never restart, joiners heal from live peers.

- `plan`: who leaves, stays and joins, and the new ranks (pure).
- `rendezvous`: this process's store, the store a formation meets at, a group's liveness.
- `membership_view`: the group's hosts, pushed memberships, and which agreed notice changes the group.
- `transfer`: the state of a change, from the ranks that hold it to the new group (shards peer to
  peer: `reshard_plan` who sends which rows, `reshard_transfer` the batched p2p, `reshard_state`
  a model and optimizer as pieces and layouts).
- `nccl`: the NCCL recipe (version and environment checks, eager communicators, abort).
- `torch_private`: every private torch API reached, in one checked module.
- `join`: `init_process_group()` for in-place jobs (start, or join a running job): it makes the
  process's group session.
The agreed-step machine (`hooks/machine`) runs a change with them, inside the process's
`hooks.group_session.GroupSession` (its groups, every timeout); `spotguard launch` starts the
workers. `reformer` only keeps the record's old names importable.
"""
from __future__ import annotations

from spotguard.hooks.elastic.join import elastic_process, init_process_group

__all__ = ["elastic_process", "init_process_group"]
