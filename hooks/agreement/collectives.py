"""The collectives the Guard runs on its own process group, or none for a process alone.

Contract: every rank calls the same methods in the same order. `max(values)` is the element-wise
maximum over the ranks; `all_ok(ok)` is True on every rank when every rank passed True;
`broadcast_bytes(payload, src)` returns `src`'s payload on every rank; `gather_strings(value)`
is every rank's string by rank; `leave()` is a last agreement and then the destruction of the
process groups, so no rank tears a connection down while a peer's gloo thread still uses it;
`abandon()` destroys them without that agreement (a rank whose part failed, so that it never
votes yes). The base class `Collectives` (a process alone) answers with its own input.
"""
from __future__ import annotations

import logging
import os
from typing import Any
from collections.abc import Sequence

log = logging.getLogger("spotguard.hooks.collectives")

INLINE_BYTES = 4096  # broadcast_bytes: payloads up to this size minus the 8-byte header take one broadcast


class Collectives:
    """A process alone (world size 1): every collective is the identity."""

    distributed = False
    rank = 0
    world_size = 1

    def max(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def all_ok(self, ok: bool) -> bool:
        return ok

    def broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        return payload

    def gather_strings(self, value: str) -> list[str]:
        """Every rank's `value`, by rank."""
        return [value]

    def leave(self) -> None:
        pass

    def abandon(self) -> None:
        """Destroys the groups without the last agreement (this rank failed: it must not vote)."""



class GroupCollectives(Collectives):
    """The collectives on a gloo process group (`group` None: a new one over every rank)."""

    distributed = True

    def __init__(self, group: Any = None):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._left = False

    def all_reduce_max_(self, tensor: Any, async_op: bool = False) -> Any:
        """In place on a preallocated tensor (the agreements' hot path); the work when async."""
        return self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX, group=self.group, async_op=async_op)

    def max(self, values: Sequence[float]) -> list[float]:
        t = self.torch.tensor(list(values), dtype=self.torch.float64)
        self.all_reduce_max_(t)
        return t.tolist()

    def all_ok(self, ok: bool) -> bool:
        return self.max([0.0 if ok else 1.0])[0] == 0.0

    def broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        """One broadcast of a fixed `INLINE_BYTES` buffer (length header + payload) for a payload
        that fits, as an agreed notice does; a second one only for the rest of a larger payload.
        Each collective on the drain's path is a round trip that a loaded machine stretches."""
        torch = self.torch
        head = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        if self.rank == src:
            head[:8].copy_(torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8))
            inline = payload[:INLINE_BYTES - 8]
            if inline:
                head[8:8 + len(inline)].copy_(torch.frombuffer(bytearray(inline), dtype=torch.uint8))
        self.dist.broadcast(head, src=src, group=self.group)
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        first = head[8:8 + min(size, INLINE_BYTES - 8)].numpy().tobytes()
        if size <= INLINE_BYTES - 8:
            return first
        rest = size - len(first)
        if self.rank == src:
            data = torch.frombuffer(bytearray(payload[len(first):]), dtype=torch.uint8)
        else:
            data = torch.empty(rest, dtype=torch.uint8)
        self.dist.broadcast(data, src=src, group=self.group)
        return first + data.numpy().tobytes()

    def gather_strings(self, value: str) -> list[str]:
        gathered: list = [None] * self.world_size
        self.dist.all_gather_object(gathered, value, group=self.group)
        return [str(v) for v in gathered]

    def abandon(self) -> None:
        if self._left:
            return
        self._left = True
        try:
            self.dist.destroy_process_group()
        except Exception as exc:  # peers may be gone already
            log.warning("process groups not destroyed cleanly: %s", exc)

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        try:
            self.all_ok(True)
            self.dist.destroy_process_group()
        except Exception as exc:  # leaving anyway
            log.warning("process groups not destroyed cleanly: %s", exc)


def join_collectives(process_group: Any = None) -> Collectives:
    """The Guard's collectives: on a group when torch.distributed runs more than one rank (the
    formation's control group, `control_group.control_groups()`, unless `process_group` is given),
    else local. Raises RuntimeError when WORLD_SIZE > 1 but no process group exists yet."""
    try:
        import torch.distributed as dist
    except ImportError:
        return Collectives()
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            if process_group is None:
                from spotguard.hooks.agreement.control_group import control_groups

                groups = control_groups()
                assert groups is not None
                process_group = groups.control
            return GroupCollectives(process_group)
    elif int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise RuntimeError("create the Guard after torch.distributed.init_process_group (WORLD_SIZE > 1)")
    return Collectives()
