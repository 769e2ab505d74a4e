"""State from a live peer: the step, the full model/optimizer state and the adapter's extras,
packed once and broadcast over the new group to the ranks that hold nothing (joiners).

Contract: every rank of the new group calls `share(collectives, state)` once, in the same place
of the re-form; `state` is this rank's `HeldState` when it holds the state (a survivor), None
when it does not (a joiner). The source is the lowest new rank holding it (one all_reduce); it
packs with `torch.save` and broadcasts the bytes; every rank returns the source's `HeldState`.
Survivors pay the broadcast too (every rank joins a collective); with no joiner the caller
skips `share`.
Raises `TransferError` when no rank holds the state.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from spotguard.hooks.agreement.collectives import Collectives


class TransferError(RuntimeError):
    """No rank of the new group holds the state, or the bytes did not unpack."""


@dataclass
class HeldState:
    """What a survivor holds at the agreed step: enough for any world size."""

    step: int  # the last completed step
    state: dict[str, Any]  # {"model": full state dict, "optim": full optimizer state dict}
    extra: dict[str, Any] = field(default_factory=dict)


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
    """(the source's state, the source's rank) on every rank; see the module docstring."""
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
