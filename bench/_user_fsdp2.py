"""A user's FSDP2 training script, written from the README: the model built by `build` (the
meta device, `fully_shard`, `to_empty`: only this rank's shards are ever allocated),
`TorchDCPAdapter(model, opt, checkpoint_dir=..., build=...)`, `Guard.from_env(adapter=...)`,
`guard.resume()`, `guard.step(step)`; nothing else of spotguard's (no `prepare()`).
bench/membership_user_path.py runs it under `spotguard launch` (in place) and under torchrun (the
relaunch). The one addition is the measurement: one JSON line per completed step in
`<out>/steps-<node>.jsonl`: `t` when the step completed, `back` when `guard.step` returned (after
a change, in the new group), `world` the world size the step ran at, and after an in-place change
`phases` (its record's phases, seconds from its start).

    python bench/_user_fsdp2.py --out DIR --ckpt DIR --dim 4096 --layers 5 --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spotguard.hooks import Guard
from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter
from spotguard.hooks.elastic import init_process_group


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend compute per step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    init_process_group()

    def build():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.01)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    ckpt = TorchDCPAdapter(*build(), checkpoint_dir=args.ckpt, build=build)
    guard = Guard.from_env(adapter=ckpt)
    start = guard.resume()
    node = os.environ.get("SPOTGUARD_NODE") or f"rank{dist.get_rank()}"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"steps-{node}.jsonl", "a", buffering=1) as steps:
        for step in range(start, args.steps):
            x = torch.full((2, args.dim), 0.01)
            ckpt.optimizer.zero_grad(set_to_none=True)
            ckpt.model(x).square().mean().backward()
            ckpt.optimizer.step()
            ckpt.optimizer.zero_grad(set_to_none=True)
            time.sleep(args.step_sleep)
            done, world = time.monotonic(), guard.world_size
            result = guard.step(step)
            line = {"step": step, "t": done, "back": time.monotonic(), "world": world, "pid": os.getpid()}
            if result.resized:  # the change's phases (seconds from its start), for the bench's split
                line["phases"] = result.resize.phases
            steps.write(json.dumps(line) + "\n")
    guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
