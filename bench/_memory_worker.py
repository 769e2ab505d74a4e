"""One rank of bench/membership_memory.py: an FSDP2 job of ~1 GiB of state (parameters and Adam
moments) through a shrink 4 -> 3 and a grow 3 -> 4, with the transfer the reformer runs
(`hooks.elastic.transfer`: hand_over in the old group, rebuild, receive and load in the new),
chosen by SPOTGUARD_RESHARD (shards | gather).

    python bench/_memory_worker.py --out DIR --host a --ports P1,P2,P3 --dim D --layers L

Hosts a, b, c, d start at 4 (port P1); d leaves (4 -> 3, port P2); e joins (3 -> 4, port P3),
starting when the bench starts it. Writes <out>/<host>.jsonl lines: {"event": "begin"|"end",
"change": "shrink"|"grow", "t": time.monotonic()} around each change this host takes part in,
and at each end "new_shard_bytes" (its pieces' bytes after the change), "sent_bytes",
"planned_bytes"/"minimum_bytes" (the shards plan's), "seconds".
"""
from __future__ import annotations

import argparse
import itertools
import json
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


def builder(dim: int, layers: int):
    """FSDP2 over the current group, made on the meta device: only this rank's shards are ever
    allocated (the values are a deterministic fill; a change overwrites them)."""

    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=True) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(0.001 * (dist.get_rank() + 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    return build


def train_step(adapter, dim: int) -> None:
    x = torch.full((2, dim), 0.01)
    adapter.optimizer.zero_grad(set_to_none=True)
    adapter.model(x).square().mean().backward()
    adapter.optimizer.step()
    adapter.optimizer.zero_grad(set_to_none=True)


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
    args = p.parse_args()
    torch.set_num_threads(1)
    ports = [int(x) for x in args.ports.split(",")]
    log = open(Path(args.out) / f"{args.host}.jsonl", "a", buffering=1)

    def note(**fields) -> None:
        log.write(json.dumps({"t": time.monotonic(), **fields}) + "\n")

    build = builder(args.dim, args.layers)
    adapter = None
    for index, (old, new) in enumerate(itertools.pairwise(HOSTS)):
        reform = ReformPlan.make(old, new)
        change = "shrink" if index == 0 else "grow"
        held = None
        if args.host in old:
            if adapter is None:
                form(ports[0], old.index(args.host), len(old))
                adapter = TorchDCPAdapter(*build(), checkpoint_dir=Path(args.out) / "ckpt", build=build)
                train_step(adapter, args.dim)
                dist.barrier()
            note(event="ready", change=change)
            dist.barrier()
            time.sleep(1.0)  # a quiet baseline for the sampler
            t0 = time.monotonic()
            note(event="begin", change=change)
            held = hand_over(GroupCollectives(), adapter, 0, {}, reform)
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
        held = receive(GroupCollectives(), adapter, held, share_first=True)
        load(adapter, held)
        plan, sent = held.plan, held.sent_bytes
        del held
        seconds = time.monotonic() - t0
        note(event="end", change=change, seconds=seconds, new_shard_bytes=shard_bytes(adapter),
             sent_bytes=sent if plan is not None else None,
             planned_bytes=plan.moved_bytes() if plan else None, minimum_bytes=plan.minimum_bytes() if plan else None)
        dist.barrier()
        time.sleep(0.5)
        train_step(adapter, args.dim)  # the new state trains
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
