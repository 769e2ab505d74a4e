"""Which rank sends which rows of which tensor to which rank when the group's size changes: the
pure arithmetic of a reshard (no torch, no communication).

A tensor's layout is data, `Layout(mesh, placements)`: the mesh's shape (its ranks are the
group's, in rank order, row-major) and one placement per mesh dimension, `SHARD0` (torch's
`Shard(0)`: dimension 0 cut as `torch.chunk` cuts it, ceil(rows / n) rows per piece, the last
pieces shorter or empty; FSDP2 pads its local storage to that size, the padding is local and never
moves) or `REPLICATE`. FSDP2 is `((world,), (SHARD0,))`, DDP and every tensor all ranks hold (a
step counter) `((world,), (REPLICATE,))`, HSDP `((replicas, shards), (REPLICATE, SHARD0))`. Any
other placement is kept as the string it came as (e.g. "Shard(dim=1)") and refused.

`ReshardPlan.make(tensors, old_world, new_world, survivors)` (`survivors`: old rank -> new rank of
every rank that stays; every other old rank leaves, every other new rank joins) gives, the same on
every rank:
- `keeps`: rows a staying rank already holds and keeps (copied locally, never sent);
- `moves`: every other row a new rank needs, from one holder: a leaving rank's rows come from it
  (it sends while still in the old group), a joiner's from a staying rank; a replica comes whole
  from one peer. Ordered the same on every rank (tensor order, then destination, then rows).
- `relays`: rows a joiner needs that only leaving ranks hold (a replacement of hosts in one
  change: the leaving rank is gone before the joiner arrives). They travel through a staying
  rank (`via`): the leaving rank sends them to it in the old group, it forwards them to the
  joiner in the new one. Same order rule as `moves`.
- `minimum_bytes()`: what the two layouts require to move at least (every byte a new rank needs
  and did not hold), `moved_bytes()` what the moves and relays carry (the minimum, plus the
  relayed bytes once more for their second hop).
The new layout is the old one at the new size (`resized`): a 1-D mesh takes any size, a 2-D one
keeps its shard count and changes its replica count. Refused with `ReshardError` naming the
tensor and its placement, before anything moves: an unknown placement, more than one sharded
mesh dimension, a mesh that is not the group, a world size the mesh cannot take.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SHARD0 = "Shard(dim=0)"
REPLICATE = "Replicate()"
KNOWN = (SHARD0, REPLICATE)
_ZERO = re.compile(r"ZeroPartition\(align=([1-9][0-9]*)\)")


def zero_partition(align: int) -> str:
    """The placement of a ZeRO-1/2 flat partition whose size is a multiple of `align` items."""
    return f"ZeroPartition(align={int(align)})"


def _alignment(placement: str) -> int | None:
    """The piece-size multiple of a placement that cuts dimension 0 (SHARD0: 1), else None."""
    if placement == SHARD0:
        return 1
    match = _ZERO.fullmatch(placement)
    return int(match.group(1)) if match else None


class ReshardError(ValueError):
    """A layout the plan cannot map; the message names the tensor and its placement."""


@dataclass(frozen=True)
class Layout:
    mesh: tuple[int, ...]  # ranks per mesh dimension; their product is the world size
    placements: tuple[str, ...]  # one per mesh dimension: SHARD0, REPLICATE (others are refused)

    @classmethod
    def sharded(cls, world: int) -> Layout:
        return cls((world,), (SHARD0,))

    @classmethod
    def replicated(cls, world: int) -> Layout:
        return cls((world,), (REPLICATE,))

    def __str__(self) -> str:
        return f"[{', '.join(self.placements)}] on mesh {self.mesh}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    rows: int  # size of dimension 0 (1 for a 0-d tensor)
    row_bytes: int  # bytes of one row (the product of the other dimensions times the item size)
    layout: Layout  # the old layout


@dataclass(frozen=True)
class Keep:
    tensor: int  # index into the plan's tensors
    old_rank: int
    new_rank: int
    start: int  # global rows [start, stop)
    stop: int


@dataclass(frozen=True)
class Move:
    tensor: int
    src: int  # old rank of the sender
    dst: int  # new rank of the receiver
    start: int  # global rows [start, stop)
    stop: int


@dataclass(frozen=True)
class Relay:
    tensor: int
    src: int  # old rank of the leaving sender
    via: int  # old rank of the staying rank that holds the rows between the two hops
    dst: int  # new rank of the joiner
    start: int  # global rows [start, stop)
    stop: int


def _fail(spec: TensorSpec, layout: Layout, why: str) -> ReshardError:
    return ReshardError(f"tensor {spec.name!r} with placement {layout}: {why}")


def _check(spec: TensorSpec, layout: Layout, world: int) -> None:
    if len(layout.mesh) != len(layout.placements) or not layout.mesh:
        raise _fail(spec, layout, "needs one placement per mesh dimension")
    for placement in layout.placements:
        if placement != REPLICATE and _alignment(placement) is None:
            raise _fail(spec, layout, f"placement {placement} is not supported (only {SHARD0}, {REPLICATE} and "
                                      f"{zero_partition(2)})")
    sharded = [p for p in layout.placements if p != REPLICATE]
    if len(sharded) > 1:
        raise _fail(spec, layout, "dimension 0 sharded over more than one mesh dimension is not supported")
    if sharded and sharded[0] != SHARD0 and len(layout.mesh) > 1:
        raise _fail(spec, layout, "a ZeRO partition needs a 1-D mesh")
    if math.prod(layout.mesh) != world:
        raise _fail(spec, layout, f"the mesh holds {math.prod(layout.mesh)} ranks, the group {world}")


def resized(spec: TensorSpec, new_world: int) -> Layout:
    """The spec's layout at `new_world` ranks (see the module docstring); ReshardError otherwise."""
    layout = spec.layout
    if len(layout.mesh) == 1:
        return Layout((new_world,), layout.placements)
    growing = [d for d, p in enumerate(layout.placements) if p == REPLICATE]
    fixed = math.prod(n for d, n in enumerate(layout.mesh) if d not in growing)
    if len(growing) != 1:
        raise _fail(spec, layout, "a mesh of several dimensions needs exactly one replicated dimension to resize")
    if new_world % fixed:
        raise _fail(spec, layout, f"world size {new_world} cannot take this mesh (a multiple of {fixed} is needed)")
    mesh = list(layout.mesh)
    mesh[growing[0]] = new_world // fixed
    return Layout(tuple(mesh), layout.placements)


def _coords(rank: int, mesh: Sequence[int]) -> list[int]:
    coords = []
    for n in reversed(mesh):
        coords.append(rank % n)
        rank //= n
    return coords[::-1]


def piece_size(rows: int, n: int, align: int = 1) -> int:
    """The rows of each of n pieces over `rows` rows: torch.chunk's (align 1), or a ZeRO partition's
    (rounded up to a multiple of `align`; the last pieces hold the padding)."""
    return -(-rows // (n * align)) * align


def _piece(rows: int, n: int, k: int, align: int = 1) -> tuple[int, int]:
    """Piece k of n over `rows` rows (`piece_size`), without its padding."""
    size = piece_size(rows, n, align)
    return min(k * size, rows), min((k + 1) * size, rows)


def held_rows(layout: Layout, rows: int, rank: int) -> tuple[int, int]:
    """The global rows [start, stop) `rank` holds under `layout`."""
    coords = _coords(rank, layout.mesh)
    for dim, placement in enumerate(layout.placements):
        align = _alignment(placement)
        if align is not None:
            return _piece(rows, layout.mesh[dim], coords[dim], align)
    return 0, rows


def _blocks(layout: Layout, rows: int, world: int) -> list[tuple[int, int, list[int]]]:
    """(start, stop, holders) for every distinct piece of `layout`, holders in rank order."""
    found: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        found.setdefault(held_rows(layout, rows, rank), []).append(rank)
    return [(a, b, holders) for (a, b), holders in sorted(found.items()) if b > a]


def _minus(need: tuple[int, int], have: tuple[int, int]) -> list[tuple[int, int]]:
    a, b = need
    c, d = max(have[0], a), min(have[1], b)
    if c >= d:
        return [need] if b > a else []
    return [(x, y) for x, y in ((a, c), (d, b)) if y > x]


@dataclass(frozen=True)
class ReshardPlan:
    tensors: tuple[TensorSpec, ...]
    new_layouts: tuple[Layout, ...]
    old_world: int
    new_world: int
    survivors: Mapping[int, int]  # old rank -> new rank
    keeps: tuple[Keep, ...]
    moves: tuple[Move, ...]
    relays: tuple[Relay, ...] = ()

    @classmethod
    def make(cls, tensors: Sequence[TensorSpec], old_world: int, new_world: int,
             survivors: Mapping[int, int]) -> ReshardPlan:
        if old_world < 1 or new_world < 1:
            raise ReshardError(f"world sizes must be >= 1, got {old_world} -> {new_world}")
        if sorted(survivors.values()) != sorted(set(survivors.values())) or \
                any(not 0 <= o < old_world or not 0 <= n < new_world for o, n in survivors.items()):
            raise ReshardError(f"survivors {dict(survivors)} do not map old ranks to distinct new ranks")
        if not survivors:
            raise ReshardError("no rank stays: nobody could hand the state over")
        old_of = {new: old for old, new in survivors.items()}
        keeps: list[Keep] = []
        moves: list[Move] = []
        relays: list[Relay] = []
        vias = sorted(survivors)
        new_layouts = []
        for spec in tensors:  # every layout first: a refusal names the tensor that cannot be mapped
            _check(spec, spec.layout, old_world)
            new_layouts.append(resized(spec, new_world))
            _check(spec, new_layouts[-1], new_world)
        for index, (spec, new_layout) in enumerate(zip(tensors, new_layouts)):
            blocks = _blocks(spec.layout, spec.rows, old_world)
            for dst in range(new_world):
                need = held_rows(new_layout, spec.rows, dst)
                old = old_of.get(dst)
                have = held_rows(spec.layout, spec.rows, old) if old is not None else (0, 0)
                kept = (max(need[0], have[0]), min(need[1], have[1]))
                if old is not None and kept[1] > kept[0]:
                    keeps.append(Keep(index, old, dst, *kept))
                for a, b in _minus(need, have):
                    for c, d, holders in blocks:
                        lo, hi = max(a, c), min(b, d)
                        if lo >= hi:
                            continue
                        staying = [h for h in holders if h in survivors]
                        if old is None and not staying:  # the leaving holders are gone when dst joins
                            relays.append(Relay(index, holders[dst % len(holders)], vias[(dst + lo) % len(vias)],
                                                dst, lo, hi))
                            continue
                        pool = staying or holders
                        moves.append(Move(index, pool[dst % len(pool)], dst, lo, hi))
        return cls(tuple(tensors), tuple(new_layouts), old_world, new_world, dict(survivors), tuple(keeps),
                   tuple(moves), tuple(relays))

    def leaves(self, old_rank: int) -> bool:
        return old_rank not in self.survivors

    def new_rows(self, tensor: int, new_rank: int) -> tuple[int, int]:
        return held_rows(self.new_layouts[tensor], self.tensors[tensor].rows, new_rank)

    def old_rows(self, tensor: int, old_rank: int) -> tuple[int, int]:
        return held_rows(self.tensors[tensor].layout, self.tensors[tensor].rows, old_rank)

    def moved_bytes(self) -> int:
        """Bytes sent by all ranks: the moves once, the relays twice (two hops)."""
        return sum((m.stop - m.start) * self.tensors[m.tensor].row_bytes for m in self.moves) + \
            2 * self.relayed_bytes()

    def relayed_bytes(self) -> int:
        return sum((r.stop - r.start) * self.tensors[r.tensor].row_bytes for r in self.relays)

    def minimum_bytes(self) -> int:
        """Bytes every new rank needs and did not hold before (computed apart from the moves)."""
        old_of = {new: old for old, new in self.survivors.items()}
        total = 0
        for index, spec in enumerate(self.tensors):
            for dst in range(self.new_world):
                need = self.new_rows(index, dst)
                old = old_of.get(dst)
                have = self.old_rows(index, old) if old is not None else (0, 0)
                total += sum(b - a for a, b in _minus(need, have)) * spec.row_bytes
        return total
