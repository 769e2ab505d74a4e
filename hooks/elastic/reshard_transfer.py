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
class _Piece:
    move: Move
    src: int  # group ranks
    dst: int
    start: int  # bytes [start, stop) of the tensor, global
    stop: int


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("reshard pieces must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def _pieces(plan: ReshardPlan, moves: Sequence[Move], src_of: Callable[[int], int], dst_of: Callable[[int], int],
            bucket_bytes: int) -> list[_Piece]:
    step = max(bucket_bytes // _ALIGN * _ALIGN, _ALIGN)
    out: list[_Piece] = []
    for move in moves:
        row = plan.tensors[move.tensor].row_bytes
        start, stop = move.start * row, move.stop * row
        out.extend(_Piece(move, src_of(move.src), dst_of(move.dst), a, min(a + step, stop))
                   for a in range(start, stop, step))
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


def run_moves(plan: ReshardPlan, moves: Sequence[Move], me: int, group_rank_of_src: Callable[[int], int],
              group_rank_of_dst: Callable[[int], int], sources: dict[int, torch.Tensor],
              targets: dict[int, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    import torch.distributed as dist

    sent = 0
    for round_ in _rounds(_pieces(plan, moves, group_rank_of_src, group_rank_of_dst, bucket_bytes), bucket_bytes):
        ops = []
        for piece in round_:
            move, row = piece.move, plan.tensors[piece.move.tensor].row_bytes
            if piece.src == me:
                base = plan.old_rows(move.tensor, move.src)[0] * row
                view = _bytes(sources[move.tensor])[piece.start - base:piece.stop - base]
                ops.append(dist.P2POp(dist.isend, view, piece.dst))
                sent += piece.stop - piece.start
            elif piece.dst == me:
                base = plan.new_rows(move.tensor, move.dst)[0] * row
                view = _bytes(targets[move.tensor])[piece.start - base:piece.stop - base]
                ops.append(dist.P2POp(dist.irecv, view, piece.src))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    return sent


def copy_keeps(plan: ReshardPlan, keeps: Sequence[Keep], sources: dict[int, torch.Tensor],
               targets: dict[int, torch.Tensor]) -> None:
    for keep in keeps:
        row = plan.tensors[keep.tensor].row_bytes
        old, new = plan.old_rows(keep.tensor, keep.old_rank)[0], plan.new_rows(keep.tensor, keep.new_rank)[0]
        _bytes(targets[keep.tensor])[(keep.start - new) * row:(keep.stop - new) * row].copy_(
            _bytes(sources[keep.tensor])[(keep.start - old) * row:(keep.stop - old) * row])
