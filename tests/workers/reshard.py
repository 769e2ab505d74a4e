"""One rank of a shrink or grow through the peer-to-peer transfer alone (no Guard, no store of
spotguard's): the old group trains a few steps, hands over, the new group forms on another port,
rebuilds, receives and loads; the full state is dumped before (old rank 0: what the agreed
checkpoint holds) and after (new rank 0) for a bit-exact comparison, and one more step is trained.

    python reshard.py --mode ddp|fsdp2 --out DIR --old-hosts a,b,c --new-hosts a,b --me a
        --old-port P --new-port Q [--steps 3]
A host in --new-hosts but not in --old-hosts is a joiner (it starts in the new group).
Writes state-before.pt, state-after.pt, sent-<host> (bytes sent), planned (the plan's moved and
minimum bytes), exit-<host>.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
from spotguard.hooks.agreement.collectives import GroupCollectives
from spotguard.hooks.elastic.plan import ReformPlan
from spotguard.hooks.elastic.reshard_plan import ReshardError
from spotguard.hooks.elastic.transfer import hand_over, load, receive
from spotguard.trainer.elastic_job import base_model, batch, build_for
from launch import assert_same_state
from state_dump import flatten


def full(adapter) -> dict[str, torch.Tensor]:
    model_state, optim_state = get_state_dict(adapter.model, adapter.optimizer,
                                              options=StateDictOptions(full_state_dict=True))
    return flatten(model_state, optim_state)


def train(adapter, step: int) -> None:
    x, y = batch(step, dist.get_rank(), dist.get_world_size())
    adapter.optimizer.zero_grad()
    torch.nn.functional.mse_loss(adapter.model(x), y).backward()
    adapter.optimizer.step()


def refused_build():
    """FSDP2 whose first weight is sharded on dimension 1, a placement the plan cannot map."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = base_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def form(port: int, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--old-hosts", required=True)
    p.add_argument("--new-hosts", required=True)
    p.add_argument("--me", required=True)
    p.add_argument("--old-port", type=int, required=True)
    p.add_argument("--new-port", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--refuse", action="store_true",
                   help="FSDP2 with one weight sharded on dim 1: the plan must refuse before anything moves")
    args = p.parse_args()
    out = Path(args.out)
    reform = ReformPlan.make(args.old_hosts.split(","), args.new_hosts.split(","))
    build = refused_build if args.refuse else build_for(args.mode)
    held = None
    step = args.steps - 1
    if args.me in reform.old_hosts:
        old_rank = reform.old_hosts.index(args.me)
        form(args.old_port, old_rank, reform.old_world_size)
        adapter = TorchDCPAdapter(*build(), checkpoint_dir=out / "ckpt", build=build)
        for s in range(args.steps):
            train(adapter, s)
        state = full(adapter)
        if old_rank == 0:
            torch.save(state, out / "state-before.pt")
        if args.refuse:
            try:
                hand_over(GroupCollectives(), adapter, step, {"pos": 7}, reform)
            except ReshardError as exc:
                assert_same_state(state, full(adapter))  # nothing moved, nothing lost
                (out / f"refused-{args.me}").write_text(str(exc))
            dist.destroy_process_group()
            return 0
        held = hand_over(GroupCollectives(), adapter, step, {"pos": 7}, reform)
        (out / f"sent-{args.me}").write_text(str(held.sent_bytes))
        if old_rank == 0:
            (out / "planned").write_text(json.dumps([held.plan.moved_bytes(), held.plan.minimum_bytes()]))
        dist.destroy_process_group()
        if reform.new_rank(old_rank) is None:
            return 0
        form(args.new_port, reform.new_rank(old_rank), reform.new_world_size)
        adapter.rebuild()
    else:
        form(args.new_port, reform.joiner_rank(args.me, 0), reform.new_world_size)
        model, optimizer = build()
        adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=out / "ckpt", build=build)
    sent_before = held.sent_bytes if held is not None else 0
    held = receive(GroupCollectives(), adapter, held, share_first=True)
    load(adapter, held)
    (out / f"sent-{args.me}").write_text(str(held.sent_bytes))
    assert held.step == step and held.extra == {"pos": 7}, (held.step, held.extra, sent_before)
    state = full(adapter)
    if dist.get_rank() == 0:
        torch.save(state, out / "state-after.pt")
    train(adapter, args.steps)  # the loaded state trains on
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past gloo's teardown at interpreter exit, which can abort ("terminate called ...") under load
