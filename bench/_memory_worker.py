"""One rank of bench/membership_memory.py: an FSDP2 job of ~1 GiB of state (parameters and Adam
moments) through a shrink 4 -> 3 and a grow 3 -> 4, with the transfer the agreed-step machine runs
(`hooks.elastic.transfer`: hand_over in the old group, rebuild, receive and load in the new),
chosen by SPOTGUARD_RESHARD (shards | gather).

    python bench/_memory_worker.py --out DIR --host a --ports P1,P2,P3 --dim D --layers L [--digests]

Hosts a, b, c, d start at 4 (port P1); d leaves (4 -> 3, port P2); e joins (3 -> 4, port P3),
starting when the bench starts it. The old group's ranks take one optimizer step on gradients
of their own (no collective: it only gives the AdamW moments their values); the shrink is
followed by another such step, the grow by one real training step (FSDP2 forward, backward,
optimizer) in the new group (a real step over 1 GiB of state costs ~10 s on 2 loaded cores).
Writes <out>/<host>.jsonl lines: {"event": "begin"|"end", "change": "shrink"|"grow",
"t": time.monotonic()} around each change this host takes part in, and at each end
"new_shard_bytes" (its pieces' bytes after the change), "sent_bytes", "planned_bytes"/
"minimum_bytes" (the shards plan's), "seconds", "agreed_step" / "held_step" (the step handed
over and the one received); then a "trained" line with AdamW's step count after the step that
follows and the loss of a real step (None after the optimizer-only one). With --digests, also
<out>/<host>-<change>-before.json (old group, before the change) and -after.json (new group,
after the load, before training): `row_digests` of the live model and optimizer, read
independently of the reshard code.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.device_mesh  # imported before any baseline, as a joiner's warm-up does
import torch.distributed.fsdp
import torch.distributed.tensor

from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
from spotguard.hooks.agreement.collectives import GroupCollectives
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.hooks.elastic.transfer import hand_over, load, receive

HOSTS = (("a", "b", "c", "d"), ("a", "b", "c"), ("a", "b", "c", "e"))


def builder(dim: int, layers: int, reshard_after_forward: bool = True):
    """FSDP2 over the current group, made on the meta device: only this rank's shards are ever
    allocated (the values are a deterministic fill; a change overwrites them)."""

    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=True) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(dist.get_rank())
        with torch.no_grad():
            for p in model.parameters():  # every row distinct: a row moved to the wrong place shows
                p.to_local().normal_(0.0, 0.01, generator=generator)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    return build


def train_step(adapter, dim: int) -> float:
    """One real step (FSDP2's all-gathers and reduce-scatters); the loss."""
    x = torch.full((2, dim), 0.01)
    adapter.optimizer.zero_grad(set_to_none=True)
    loss = adapter.model(x).square().mean()
    loss.backward()
    adapter.optimizer.step()
    adapter.optimizer.zero_grad(set_to_none=True)
    return float(loss)


def moments_step(adapter) -> None:
    """One optimizer step on gradients made locally (each rank's own values, no collective): the
    AdamW moments get values as a training step would give them, at a fraction of its cost."""
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    for p in adapter.model.parameters():
        local = torch.randn(p.to_local().shape, generator=generator)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())
    adapter.optimizer.step()
    adapter.optimizer.zero_grad(set_to_none=True)


def adam_step(adapter) -> float:
    return float(next(iter(adapter.optimizer.state.values()))["step"])


def _digests(piece: torch.Tensor) -> list[str]:
    """A digest of each row (dimension 0; a 0-d tensor is one row) of `piece`'s bytes."""
    data = piece.detach().contiguous().reshape(-1).view(torch.uint8)
    rows = piece.shape[0] if piece.dim() else 1
    width = data.numel() // rows if rows else 0
    view = memoryview((ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())) if data.numel() else b""
    return [hashlib.blake2b(view[i * width:(i + 1) * width], digest_size=12).hexdigest() for i in range(rows)]


def row_digests(adapter) -> dict[str, dict]:
    """{tensor name: {"start": global index of this rank's first row, "rows": [digest per row],
    "total": the tensor's rows, "replica": bool}} for every parameter and optimizer state tensor
    this rank holds (read from the live model and optimizer; a Shard(0) piece's first row by
    FSDP2's rule: torch.chunk's ceil(rows / world) rows per rank)."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, dict] = {}
    world, rank = dist.get_world_size(), dist.get_rank()

    def add(name: str, value: torch.Tensor) -> None:
        if isinstance(value, DTensor):
            if tuple(value.placements) != (Shard(0),):
                raise ValueError(f"{name}: placements {value.placements}, not (Shard(0),)")
            piece, rows = value.to_local(), value.shape[0]
            start = min(rank * math.ceil(rows / world), rows)
            if piece.shape[0] != min(math.ceil(rows / world), rows - start):
                raise ValueError(f"{name}: {piece.shape[0]} local rows at rank {rank} of {world}, {rows} rows")
            out[name] = {"start": start, "rows": _digests(piece), "total": rows, "replica": False}
        else:
            whole = _digests(value)
            out[name] = {"start": 0, "rows": whole, "total": len(whole), "replica": True}

    for name, param in adapter.model.named_parameters():
        add(f"model/{name}", param)
        for key, value in adapter.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                add(f"optim/{name}/{key}", value)
    return out


def form(port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))


def shard_bytes(adapter) -> int:
    return sum(p.numel() * p.element_size() for p in adapter.shard_state().pieces)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--ports", required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--digests", action="store_true", help="write row_digests before and after each change")
    args = p.parse_args()
    torch.set_num_threads(1)
    ports = [int(x) for x in args.ports.split(",")]
    log = open(Path(args.out) / f"{args.host}.jsonl", "a", buffering=1)

    def note(**fields) -> None:
        log.write(json.dumps({"t": time.monotonic(), **fields}) + "\n")

    def digests(change: str, when: str) -> None:
        if args.digests:
            path = Path(args.out) / f"{args.host}-{change}-{when}.json"
            path.write_text(json.dumps(row_digests(adapter)))

    # Training holds the gathered layers from forward to backward: one all-gather per step, not
    # two (no step runs during a change, so the figures are the same; the steps take half as long).
    build = builder(args.dim, args.layers, reshard_after_forward=False)
    adapter = None
    step = 0  # the last step completed: the moments' step
    for index, (old, new) in enumerate(itertools.pairwise(HOSTS)):
        reform = ReformPlan.make(old, new)
        change = "shrink" if index == 0 else "grow"
        held = None
        if args.host in old:
            if adapter is None:
                form(ports[0], old.index(args.host), len(old))
                adapter = TorchDCPAdapter(*build(), checkpoint_dir=Path(args.out) / "ckpt", build=build)
                moments_step(adapter)
                dist.barrier()
            digests(change, "before")
            note(event="ready", change=change)
            dist.barrier()
            time.sleep(0.5)  # a quiet baseline for the sampler (10 ms period)
            t0 = time.monotonic()
            note(event="begin", change=change)
            held = hand_over(GroupCollectives(), adapter, step, {}, reform)
            dist.destroy_process_group()
            if args.host not in new:
                note(event="end", change=change, left=True, sent_bytes=held.sent_bytes)
                return 0
            form(ports[index + 1], new.index(args.host), len(new))
            adapter.rebuild()
        elif args.host in new:  # the joiner: it connects once the survivors are about to change (as a
            # joiner announced ready would), not minutes ahead into TCPStore's growing retry backoff
            while '"ready", "change": "grow"' not in _read(Path(args.out) / "a.jsonl"):
                time.sleep(0.05)
            note(event="ready", change=change)
            form(ports[index + 1], new.index(args.host), len(new))
            t0 = time.monotonic()
            note(event="begin", change=change)
            adapter = TorchDCPAdapter(*build(), checkpoint_dir=Path(args.out) / "ckpt", build=build)
        else:
            continue
        agreed = step if held is not None else None  # a joiner learns the step from the transfer
        held = receive(GroupCollectives(), adapter, held, share_first=True)
        load(adapter, held)
        plan, sent, held_step = held.plan, held.sent_bytes, held.step
        del held
        seconds = time.monotonic() - t0
        note(event="end", change=change, seconds=seconds, new_shard_bytes=shard_bytes(adapter),
             sent_bytes=sent if plan is not None else None, agreed_step=agreed, held_step=held_step,
             planned_bytes=plan.moved_bytes() if plan else None, minimum_bytes=plan.minimum_bytes() if plan else None)
        step = held_step
        digests(change, "after")
        dist.barrier()
        time.sleep(0.1)
        loss = None  # the new state trains on from the step it received
        if change == "grow":
            loss = train_step(adapter, args.dim)
        else:
            moments_step(adapter)
        step += 1
        note(event="trained", change=change, step=step, loss=loss, adam_step=adam_step(adapter))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
