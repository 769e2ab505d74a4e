"""One host of a series of shrinks, grows and replacements through the peer-to-peer transfer alone
(no Guard, no store of spotguard's), one process per host for the whole series.

    python reshard.py --out DIR --me a --script FILE [--steps 3]

The script (JSON) is a list of chains, run in order by every host:
`{"name": N, "mode": "ddp"|"fsdp2", "groups": [[hosts], ...], "ports": [port per group], "refuse": bool}`.
A chain's first group forms, builds its model and trains --steps steps; each next group is one
change: the old group hands over, the new group forms on its own port (a host not in the old
group is a joiner: it holds nothing), rebuilds, receives and loads, then trains one step (the
loaded state trains on; that step's state is the next change's agreed state). A host in neither
group of a change waits for the next one it is in. `refuse`: the first group's model is FSDP2
with one weight sharded on dimension 1, a placement the plan cannot map; every rank of it must
refuse the change before anything moves, its state intact, and the chain ends there.
Writes, per change `<name>-<k>` (k from 0): state-before-<change>.pt (old rank 0: what the agreed
checkpoint holds), state-after-<change>.pt (new rank 0), sent-<change>-<host> (bytes the host
sent), planned-<change> (the plan's moved and minimum bytes); refused-<name>-<host> (the refusal).
"""
from __future__ import annotations

import argparse
import itertools
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

EXTRA = {"pos": 7}  # what travels beside the state (a data position, say)


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
    # A host can wait here through the changes before its group (the whole script's start-up on
    # a loaded machine): a generous deadline, not a measure.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))


def run_chain(chain: dict, me: str, out: Path, steps: int) -> None:
    """Every change of `chain` that `me` takes part in (module docstring)."""
    groups, ports, name = chain["groups"], chain["ports"], chain["name"]
    build = refused_build if chain.get("refuse") else build_for(chain["mode"])
    adapter = None
    if me in groups[0]:
        form(ports[0], groups[0].index(me), len(groups[0]))
        adapter = TorchDCPAdapter(*build(), checkpoint_dir=out / f"ckpt-{name}", build=build)
        for s in range(steps):
            train(adapter, s)
    for k, (old, new) in enumerate(itertools.pairwise(groups)):
        change, step = f"{name}-{k}", steps - 1 + k  # one step trained after each change
        reform = ReformPlan.make(old, new)
        held = None
        if me in old:
            old_rank = old.index(me)
            state = full(adapter)
            if old_rank == 0:
                torch.save(state, out / f"state-before-{change}.pt")
            if chain.get("refuse"):
                try:
                    hand_over(GroupCollectives(), adapter, step, EXTRA, reform)
                except ReshardError as exc:
                    assert_same_state(state, full(adapter))  # nothing moved, nothing lost
                    (out / f"refused-{name}-{me}").write_text(str(exc))
                dist.destroy_process_group()
                return
            held = hand_over(GroupCollectives(), adapter, step, EXTRA, reform)
            (out / f"sent-{change}-{me}").write_text(str(held.sent_bytes))
            if old_rank == 0:
                (out / f"planned-{change}").write_text(json.dumps([held.plan.moved_bytes(),
                                                                   held.plan.minimum_bytes()]))
            dist.destroy_process_group()
            if reform.new_rank(old_rank) is None:
                adapter = None
                continue
            form(ports[k + 1], reform.new_rank(old_rank), reform.new_world_size)
            adapter.rebuild()
        elif me in new:
            form(ports[k + 1], reform.joiner_rank(me, 0), reform.new_world_size)
            adapter = TorchDCPAdapter(*build(), checkpoint_dir=out / f"ckpt-{name}", build=build)
        else:
            continue
        held = receive(GroupCollectives(), adapter, held, share_first=True)
        load(adapter, held)
        (out / f"sent-{change}-{me}").write_text(str(held.sent_bytes))
        assert held.step == step and held.extra == EXTRA, (change, held.step, held.extra)
        state = full(adapter)
        if dist.get_rank() == 0:
            torch.save(state, out / f"state-after-{change}.pt")
        train(adapter, step + 1)  # the loaded state trains on
    if adapter is not None:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--me", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    for chain in json.loads(Path(args.script).read_text()):
        run_chain(chain, args.me, Path(args.out), args.steps)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past gloo's teardown at interpreter exit, which can abort ("terminate called ...") under load
