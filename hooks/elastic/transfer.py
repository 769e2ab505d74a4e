"""The state of a change moves from the ranks that hold it to the ranks of the new group.

Two transfers, one entry point. The default (`SPOTGUARD_RESHARD` unset or `shards`) moves
shards peer to peer (`reshard_plan`, `reshard_transfer`): no rank holds more than its old and its
new pieces, nothing is pickled, and only what the layouts require moves. `SPOTGUARD_RESHARD=gather`
(every rank of a job alike) is the earlier transfer, kept for comparison (bench/membership_memory)
and for adapters without shard methods: the full state gathered on every rank, packed with
`torch.save`, broadcast to joiners.

Contract, on every rank of a change:
1. `hand_over(collectives, adapter, step, extra, reform)` in the OLD group, before it is left:
   every rank maps its adapter's tensors (`adapter.shard_state()`) onto the new world size
   (`ReshardPlan`); one `all_ok` on `collectives`: when any rank's plan refused a layout
   (`ReshardError` naming tensor and placement), or its state or the extras are not JSON, or
   `SPOTGUARD_RESHARD_BUCKET_MB` is not a positive number, every rank raises here, before any byte moved,
   and the change falls back to the checkpoint it wrote. Then each staying rank allocates its new
   pieces and copies the rows it keeps (in a thread, beside the receive: the two fill disjoint
   rows), and the leaving ranks send their rows to the staying ranks (they are gone before the
   new group forms), and the rows a joiner needs that only they hold
   (a replacement of hosts) to the staying rank that relays them (`plan.relays`). Returns the
   `HeldState` a staying rank carries into the new group (a leaving rank drops it).
2. `receive(collectives, adapter, held)` in the NEW group (`held` None on a joiner): the lowest
   rank holding state broadcasts the manifest (step, extras, old world, survivors, tensor names,
   shapes, layouts; JSON, a few bytes per tensor), every rank makes the same plan, joiners allocate
   their pieces (a parameter or buffer of the model the joiner built, of the plan's shape, is
   received straight into that model's own piece: no second copy of the parameters), and the
   staying ranks send joiners and each other the rows that moved between them, then the relayed
   rows on to their joiners. Returns the `HeldState` every rank then loads.
3. `load(adapter, held)`: the pieces become the rebuilt model's and optimizer's state
   (`adapter.load_shards`); with the gather transfer, `adapter.load_full_state`.
`held.sent_bytes` counts the bytes this rank sent, `held.plan` is the plan (tests, bench).
Raises `TransferError` when no rank of the new group holds the state.
"""
from __future__ import annotations

import io
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spotguard.hooks.agreement.collectives import Collectives
from spotguard.hooks.elastic.reshard_plan import ReshardError, ReshardPlan

ENV_RESHARD = "SPOTGUARD_RESHARD"
ENV_BUCKET_MB = "SPOTGUARD_RESHARD_BUCKET_MB"


class TransferError(RuntimeError):
    """No rank of the new group holds the state, or the bytes did not unpack."""


@dataclass
class HeldState:
    """What a rank carries from the old group into the new one."""

    step: int  # the last completed step
    state: dict[str, Any] | None  # the gather transfer's full state; None with shards
    extra: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None  # shards: what the old group held (see reshard_state)
    old_world: int = 0
    survivors: dict[int, int] = field(default_factory=dict)  # old rank -> new rank
    sources: dict[int, Any] = field(default_factory=dict)  # tensor index -> this rank's old piece
    targets: dict[int, Any] = field(default_factory=dict)  # tensor index -> this rank's new piece
    relayed: dict[int, Any] = field(default_factory=dict)  # relay index -> rows held for a joiner
    plan: ReshardPlan | None = None
    sent_bytes: int = 0


def gathering(adapter: Any) -> bool:
    mode = os.environ.get(ENV_RESHARD, "shards") or "shards"
    if mode not in ("shards", "gather"):
        raise ValueError(f"{ENV_RESHARD} must be 'shards' or 'gather', not {mode!r}")
    return mode == "gather" or not hasattr(adapter, "shard_state")


def _bucket_bytes() -> int:
    from spotguard.hooks.elastic.reshard_transfer import DEFAULT_BUCKET_BYTES

    value = os.environ.get(ENV_BUCKET_MB)
    if not value:
        return DEFAULT_BUCKET_BYTES
    try:
        mb = float(value)
        if mb <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV_BUCKET_MB} must be a positive number of MiB, not {value!r}") from None
    return int(mb * (1 << 20))


def _plan(manifest: dict[str, Any], old_world: int, new_world: int, survivors: dict[int, int]) -> ReshardPlan:
    from spotguard.hooks.elastic.reshard_state import specs

    return ReshardPlan.make(specs(manifest), old_world, new_world, survivors)


def _allocate(held: HeldState, new_rank: int, device: Any, own: dict[str, Any] | None = None) -> None:
    """This rank's new pieces: `own[name]` (a piece this rank's model already holds) where it has
    the plan's shape and dtype and is contiguous, else a new empty piece."""
    from spotguard.hooks.elastic.reshard_state import empty_piece, local_shape

    assert held.plan is not None and held.manifest is not None
    for index, entry in enumerate(held.manifest["entries"]):
        start, stop = held.plan.new_rows(index, new_rank)
        piece = (own or {}).get(entry["name"])
        if piece is None or not piece.is_contiguous() or list(piece.shape) != local_shape(entry, stop - start) \
                or str(piece.dtype).removeprefix("torch.") != entry["dtype"]:
            piece = empty_piece(entry, stop - start, device)
        held.targets[index] = piece


def _model_pieces(adapter: Any) -> dict[str, Any]:
    """The parameters' and buffers' local pieces of the model `adapter` holds, by manifest name."""
    mine = adapter.shard_state()
    return {entry["name"]: piece for entry, piece in zip(mine.manifest["entries"], mine.pieces)
            if entry["name"].startswith(("model/", "buffer/"))}


_keepers = ThreadPoolExecutor(1, thread_name_prefix="spotguard-reshard-keep")


def hand_over(collectives: Collectives, adapter: Any, step: int, extra: dict[str, Any], reform: Any) -> HeldState:
    """Step 1 of the module docstring (old group)."""
    if gathering(adapter):
        return HeldState(step, adapter.full_state(), extra)
    from spotguard.hooks.elastic.reshard_state import empty_piece
    from spotguard.hooks.elastic.reshard_transfer import copy_keeps, relay_hops, run_hops, run_moves

    survivors = {old: reform.new_rank(old) for old in reform.survivors}
    me = collectives.rank
    refusal: Exception | None = None
    try:
        shards = adapter.shard_state()  # a DeepSpeed state that cannot travel raises here, on this rank only
        plan = _plan(shards.manifest, reform.old_world_size, reform.new_world_size, survivors)
        bucket = _bucket_bytes()
        json.dumps(extra)  # it travels in the new group's header
    except (ReshardError, ValueError, TypeError) as exc:
        refusal = exc
    if not collectives.all_ok(refusal is None):
        raise refusal or ReshardError("another rank refused the reshard plan (its log names the tensor)")
    held = HeldState(step, None, extra, shards.manifest, reform.old_world_size, survivors,
                     dict(enumerate(shards.pieces)), plan=plan)
    new_rank = survivors.get(me)
    keeping: Future | None = None
    if new_rank is not None:
        _allocate(held, new_rank, shards.device)
        keeps = [k for k in plan.keeps if k.old_rank == me]  # rows the leavers' moves never touch: beside them
        keeping = _keepers.submit(copy_keeps, plan, keeps, held.sources, held.targets)
    old_of = {new: old for old, new in survivors.items()}
    from_leavers = [m for m in plan.moves if plan.leaves(m.src)]
    try:
        held.sent_bytes = run_moves(plan, from_leavers, me, lambda old: old, lambda new: old_of[new], held.sources,
                                    held.targets, bucket)
    except BaseException:
        if keeping is not None:
            keeping.exception()  # the copy ends before its rows are given up; the moves' error is the one raised
        raise
    if keeping is not None:
        keeping.result()
    if plan.relays:  # a joiner's rows that only leaving ranks hold: to a staying rank now
        entries = shards.manifest["entries"]
        held.relayed = {i: empty_piece(entries[r.tensor], r.stop - r.start, shards.device)
                        for i, r in enumerate(plan.relays) if r.via == me}
        held.sent_bytes += run_hops(plan, relay_hops(plan, second=False), me, held.sources, held.relayed, bucket)
    return held


def _header(held: HeldState) -> bytes:
    return json.dumps({"step": held.step, "extra": held.extra, "old_world": held.old_world,
                       "survivors": sorted(held.survivors.items()), "manifest": held.manifest}).encode()


def receive(collectives: Collectives, adapter: Any, held: HeldState | None, *, share_first: bool) -> HeldState:
    """Step 2 of the module docstring (new group); `share_first`: whether anybody joins (gather)."""
    if gathering(adapter):
        if share_first or held is None:
            held, _source = share(collectives, held)
        return held
    from spotguard.hooks.elastic.reshard_transfer import relay_hops, run_hops, run_moves

    world, me = collectives.world_size, collectives.rank
    mine = -float(me) if held is not None else -float(world)
    source = int(-collectives.max([mine])[0])
    if source >= world:
        raise TransferError("no rank of the new group holds the state")
    header = json.loads(collectives.broadcast_bytes(_header(held) if me == source and held else b"", source))
    survivors = {int(old): int(new) for old, new in header["survivors"]}
    if held is None:  # a joiner
        held = HeldState(int(header["step"]), None, dict(header["extra"] or {}), header["manifest"],
                         int(header["old_world"]), survivors)
        held.plan = _plan(header["manifest"], held.old_world, world, survivors)
        _allocate(held, me, adapter.shard_device(), _model_pieces(adapter))
    assert held.plan is not None and held.plan.new_world == world, "the plan was made for another world size"
    from_staying = [m for m in held.plan.moves if not held.plan.leaves(m.src)]
    held.sent_bytes += run_moves(held.plan, from_staying, me, lambda old: survivors[old], lambda new: new,
                                 held.sources, held.targets, _bucket_bytes())
    if held.plan.relays:  # the relayed rows, on to their joiners
        held.sent_bytes += run_hops(held.plan, relay_hops(held.plan, second=True), me, held.relayed, held.targets,
                                    _bucket_bytes())
        held.relayed.clear()
    return held


def load(adapter: Any, held: HeldState) -> None:
    """Step 3 of the module docstring."""
    if held.state is not None:
        adapter.load_full_state(held.state)
        return
    assert held.manifest is not None
    held.sources.clear()  # the old pieces: the old model's, released with it
    adapter.load_shards(held.manifest, held.targets)


# ---- the gather transfer ----------------------------------------------------------------------
def pack(held: HeldState) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"step": held.step, "state": held.state, "extra": held.extra}, buffer)
    return buffer.getvalue()


def unpack(payload: bytes) -> HeldState:
    import torch

    try:
        obj = torch.load(io.BytesIO(payload), weights_only=False)
        return HeldState(int(obj["step"]), obj["state"], dict(obj.get("extra") or {}))
    except Exception as exc:
        raise TransferError(f"the state from the live peer did not unpack: {exc}") from exc


def share(collectives: Collectives, held: HeldState | None) -> tuple[HeldState, int]:
    """The gather transfer: the lowest rank holding state packs it and broadcasts the bytes;
    (the source's state, the source's rank) on every rank."""
    world = collectives.world_size
    mine = -float(collectives.rank) if held is not None else -float(world)
    source = int(-collectives.max([mine])[0])
    if source >= world:
        raise TransferError("no rank of the new group holds the state")
    payload = pack(held) if collectives.rank == source and held is not None else b""
    received = collectives.broadcast_bytes(payload, source)
    if collectives.rank == source and held is not None:
        return held, source
    return unpack(received), source
