"""The collectives the Guard runs on its own process group, or none for a process alone.

Contract: every rank calls the same methods in the same order. `max(values)` is the element-wise
maximum over the ranks; `all_ok(ok)` is True on every rank when every rank passed True;
`rank0_says(ok)` is rank 0's `ok` on every rank;
`broadcast_bytes(payload, src)` returns `src`'s payload on every rank; `gather_strings(value)`
is every rank's string by rank. The base class `Collectives` (a process alone) answers with its
own input. Collectives never destroy their group: the process's `group_session.GroupSession`
owns every group (`leave()`), and makes the Guard's collectives for each formation
(`collectives()`).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Sequence

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

    def rank0_says(self, ok: bool) -> bool:
        """Rank 0's `ok` on every rank (the others' argument is not read): an `all_ok` in which
        only rank 0 can say no."""
        return self.all_ok(ok if self.rank == 0 else True)

    def broadcast_bytes(self, payload: bytes, src: int) -> bytes:
        return payload

    def gather_strings(self, value: str) -> list[str]:
        """Every rank's `value`, by rank."""
        return [value]


class GroupCollectives(Collectives):
    """The collectives on a gloo process group (`group` None: a new one over every rank)."""

    distributed = True

    def __init__(self, group: Any = None):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = group if group is not None else dist.new_group(backend="gloo")

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
