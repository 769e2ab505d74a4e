"""Executes part of a `ReshardPlan` with batched point-to-point operations, straight from the
pieces a rank holds into the pieces it will hold: no packing, no staging copy, no full tensor.

Contract: `run_moves(plan, moves, me, group_rank_of_src, group_rank_of_dst, sources, targets,
bucket_bytes)` on every rank of the current default group, with the same `moves` (in plan
order) everywhere. `group_rank_of_src(old_rank)` / `group_rank_of_dst(new_rank)` give the
sender's and receiver's ranks in the current group, `me` this rank's. `sources[i]` is this
rank's old local piece of tensor i, `targets[i]` its new one (contiguous; read and written as
bytes, so any dtype travels as it is). Every move is cut into pieces of at most `bucket_bytes`;
the pieces go in rounds in which no rank sends or receives more than `bucket_bytes` (a piece
alone may fill a round), each round one `batch_isend_irecv`, waited before the next. Every rank
posts all of a round's operations before waiting, and every pair posts its operations in plan
order, so the rounds cannot deadlock. Returns the bytes this rank sent.
`run_hops(plan, hops, me, sends, receives, bucket_bytes)` is the same for any hops: `move_hops`
(what `run_moves` runs) or `relay_hops(plan, second)`: a relay's first hop, in the old group,
from the leaving rank's old piece into the staging buffer of the rank it goes through
(`receives[relay index]`, its rows only), or its second, in the new group, from that staging
buffer (`sends[relay index]`) into the joiner's new piece.
`copy_keeps(plan, keeps, sources, targets)` copies the rows a rank keeps (no communication).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spotguard.hooks.elastic.reshard_plan import Keep, Move, ReshardPlan

DEFAULT_BUCKET_BYTES = 32 << 20
_ALIGN = 16  # every item size divides it: pieces never cut an element


@dataclass(frozen=True)
class _Hop:
    """Rows [start, stop) of a tensor from one group rank's buffer to another's."""

    tensor: int
    src: int  # group ranks
    dst: int
    start: int  # global rows
    stop: int
    src_key: int  # the sender's buffer (a key of its `sends`) and the first global row it holds
    src_first: int
    dst_key: int  # the receiver's buffer (a key of its `receives`) and its first global row
    dst_first: int


@dataclass(frozen=True)
class _Piece:
    hop: _Hop
    start: int  # bytes [start, stop) of the tensor, global
    stop: int

    @property
    def src(self) -> int:
        return self.hop.src

    @property
    def dst(self) -> int:
        return self.hop.dst


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("reshard pieces must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def move_hops(plan: ReshardPlan, moves: Sequence[Move], src_of: Callable[[int], int],
              dst_of: Callable[[int], int]) -> list[_Hop]:
    """The moves as hops from old pieces (`sources`, by tensor) into new ones (`targets`)."""
    return [_Hop(m.tensor, src_of(m.src), dst_of(m.dst), m.start, m.stop, m.tensor,
                 plan.old_rows(m.tensor, m.src)[0], m.tensor, plan.new_rows(m.tensor, m.dst)[0]) for m in moves]


def relay_hops(plan: ReshardPlan, second: bool) -> list[_Hop]:
    """The relays' first hops (old group ranks: leaving rank's old piece -> the staying rank's
    staging buffer, by relay index) or second hops (new group ranks: staging -> the joiner's piece)."""
    hops = []
    for index, r in enumerate(plan.relays):
        if second:
            hops.append(_Hop(r.tensor, plan.survivors[r.via], r.dst, r.start, r.stop, index, r.start, r.tensor,
                             plan.new_rows(r.tensor, r.dst)[0]))
        else:
            hops.append(_Hop(r.tensor, r.src, r.via, r.start, r.stop, r.tensor, plan.old_rows(r.tensor, r.src)[0],
                             index, r.start))
    return hops


def _pieces(plan: ReshardPlan, hops: Sequence[_Hop], bucket_bytes: int) -> list[_Piece]:
    step = max(bucket_bytes // _ALIGN * _ALIGN, _ALIGN)
    out: list[_Piece] = []
    for hop in hops:
        row = plan.tensors[hop.tensor].row_bytes
        start, stop = hop.start * row, hop.stop * row
        out.extend(_Piece(hop, a, min(a + step, stop)) for a in range(start, stop, step))
    return out


def _rounds(pieces: list[_Piece], bucket_bytes: int) -> list[list[_Piece]]:
    rounds: list[list[_Piece]] = []
    load: dict[int, int] = {}
    for piece in pieces:
        size = piece.stop - piece.start
        if not rounds or any(load.get(r, 0) and load[r] + size > bucket_bytes for r in (piece.src, piece.dst)):
            rounds.append([])
            load = {}
        rounds[-1].append(piece)
        for r in (piece.src, piece.dst):
            load[r] = load.get(r, 0) + size
    return rounds


def run_hops(plan: ReshardPlan, hops: Sequence[_Hop], me: int, sends: dict[int, torch.Tensor],
             receives: dict[int, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Executes `hops` (module docstring); the bytes this rank sent."""
    import torch.distributed as dist

    sent = 0
    for round_ in _rounds(_pieces(plan, hops, bucket_bytes), bucket_bytes):
        ops = []
        for piece in round_:
            hop, row = piece.hop, plan.tensors[piece.hop.tensor].row_bytes
            if hop.src == me:
                base = hop.src_first * row
                view = _bytes(sends[hop.src_key])[piece.start - base:piece.stop - base]
                ops.append(dist.P2POp(dist.isend, view, hop.dst))
                sent += piece.stop - piece.start
            elif hop.dst == me:
                base = hop.dst_first * row
                view = _bytes(receives[hop.dst_key])[piece.start - base:piece.stop - base]
                ops.append(dist.P2POp(dist.irecv, view, hop.src))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    return sent


def run_moves(plan: ReshardPlan, moves: Sequence[Move], me: int, group_rank_of_src: Callable[[int], int],
              group_rank_of_dst: Callable[[int], int], sources: dict[int, torch.Tensor],
              targets: dict[int, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    return run_hops(plan, move_hops(plan, moves, group_rank_of_src, group_rank_of_dst), me, sources, targets,
                    bucket_bytes)


def copy_keeps(plan: ReshardPlan, keeps: Sequence[Keep], sources: dict[int, torch.Tensor],
               targets: dict[int, torch.Tensor]) -> None:
    for keep in keeps:
        row = plan.tensors[keep.tensor].row_bytes
        old, new = plan.old_rows(keep.tensor, keep.old_rank)[0], plan.new_rows(keep.tensor, keep.new_rank)[0]
        _bytes(targets[keep.tensor])[(keep.start - new) * row:(keep.stop - new) * row].copy_(
            _bytes(sources[keep.tensor])[(keep.start - old) * row:(keep.stop - old) * row])
