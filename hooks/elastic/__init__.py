"""Membership changes in place: survivors never restart, joiners heal from live peers.

- `plan`: who leaves, stays and joins, and the new ranks (pure).
- `rendezvous`: this process's store and forming a default group on a leader's store.
- `membership_view`: the group's hosts, pushed memberships, and which agreed notice changes the group.
- `transfer`: the state of a change, from the ranks that hold it to the new group (shards peer to
  peer: `reshard_plan` who sends which rows, `reshard_transfer` the batched p2p, `reshard_state`
  a model and optimizer as pieces and layouts).
- `reformer`: the change at the agreed step as one state machine (`TABLE`), both halves, with
  its fallback to the drain.
- `in_place`: the Guard's in-place side (which agreed notice changes the group, the joiner's state).
- `bound`: every group of a change waits at most the re-form timeout until the change commits.
- `nccl`: the NCCL recipe (version and environment checks, eager communicators, abort).
- `torch_private`: every private torch API reached, in one checked module.
- `join`: `init_process_group()` for in-place jobs (start, or join a running job).
The Guard (`hooks/guard.py`) drives them; `spotguard launch` starts the workers.
"""
from __future__ import annotations

from spotguard.hooks.elastic.join import elastic_process, init_process_group

__all__ = ["elastic_process", "init_process_group"]
