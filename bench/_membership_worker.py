"""One host's training process for bench/membership_change.py (one rank per host).

    python bench/_membership_worker.py --framework ddp|fsdp2|deepspeed|accelerate --ckpt DIR --out DIR

The job of `spotguard.trainer.elastic_job` (DeepSpeed: the same model under ZeRO-1), with a
synthetic compute time per step (`--step-sleep`). With `--dim D --layers L` (FSDP2 only) the
model is the memory bench's instead (`_memory_worker.builder`: L x Linear(D, D), made on the meta
device, only the shards materialised; ~1.1 GiB of parameters + AdamW moments at 4096 x 6), with
`adapter.prepare()` after the first step and after each resize (the Guard now does it at those
boundaries itself, so the call is a no-op after the first; after a resize it allocates one boundary
earlier than the Guard would).
`accelerate`: the same model and batches through `AccelerateGuard` (spotguard.integrations), in
its in-place form (`in_place=True`) under SPOTGUARD_IN_PLACE, else its restart path; its
`ElasticSampler` only keeps the position here (the batches are the job's synthetic ones).
The environment is the launcher's: torchrun's variables, plus spotguard launch's in-place ones
for the in-place path (then memberships are pushed by writing `<out>/membership.json`).
Without SPOTGUARD_IN_PLACE the Guard drains on a notice as today: every rank checkpoints the agreed step and exits 83.

Files written into --out, appended to by every process that runs as host SPOTGUARD_NODE:
- steps-<node>.jsonl: {"step", "t" (time.monotonic(), the same clock in every process of the
  machine), "wall" (time.time(), the clock of the Guard's records), "world", "pid", "optimizer"
  (seconds of the step's optimizer step)} once each step is complete, before the Guard's boundary;
- resize-<node>.jsonl: one line per in-place change, the Guard's record ("pause", "phases",
  "started": time.time() at the agreement) plus "save", the seconds of its durable checkpoint.
The job ends, exit 0, after the step named in `<out>/stop-at` (written by the bench well ahead
of every rank, so all ranks stop at the same step).
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

from spotguard.hooks.elastic import init_process_group
from spotguard.hooks.guard import Guard
from spotguard.trainer.elastic_job import base_model, batch, build_for, membership_reader, watch_memberships

FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "accelerate")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=0, help="FSDP2 at size: width of each Linear (0: the small model)")
    p.add_argument("--layers", type=int, default=6)
    return p.parse_args(argv)


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def torch_job(framework: str, ckpt: str):
    """(adapter, one_step(x, y)) for DDP / FSDP2 through the DCP adapter, resizable in place."""
    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

    build = build_for(framework)
    model, optimizer = build()
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=ckpt, build=build)

    def one_step(x, y) -> float:
        adapter.optimizer.zero_grad()
        torch.nn.functional.mse_loss(adapter.model(x), y).backward()
        return timed(adapter.optimizer.step)
    return adapter, one_step


def sized_job(ckpt: str, dim: int, layers: int):
    """(adapter, one_step(x, y)) for FSDP2 at the memory bench's size (the inputs are made here)."""
    from _memory_worker import builder

    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

    build = builder(dim, layers)
    adapter = TorchDCPAdapter(*build(), checkpoint_dir=ckpt, build=build)

    def one_step(_x, _y) -> float:
        x = torch.full((2, dim), 0.01)
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.model(x).square().mean().backward()
        seconds = timed(adapter.optimizer.step)
        adapter.optimizer.zero_grad(set_to_none=True)
        return seconds
    return adapter, one_step


def deepspeed_job(ckpt: str):
    """(adapter, one_step(x, y)) for DeepSpeed ZeRO-1 with a client AdamW, in place under
    SPOTGUARD_IN_PLACE (the engine made again for each new group: read from the adapter)."""
    from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter
    from spotguard.trainer.elastic_job import build_deepspeed, deepspeed_config

    adapter = DeepSpeedAdapter(build_deepspeed(stage=1), checkpoint_dir=ckpt, in_place=True,
                               config_for=lambda world: deepspeed_config(world, stage=1))

    def one_step(x, y) -> float:
        engine = adapter.engine
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        return timed(engine.step)
    return adapter, one_step


def accelerate_job(ckpt: str):
    """(AccelerateGuard, one_step(x, y)) through Accelerate: in place under SPOTGUARD_IN_PLACE."""
    from accelerate import Accelerator

    from spotguard.data import ElasticSampler
    from spotguard.hooks.elastic.join import in_place_enabled
    from spotguard.integrations.accelerate import AccelerateGuard
    from spotguard.trainer.elastic_job import GLOBAL_BATCH

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))  # a joiner's are unset
    accelerator = Accelerator(cpu=True)
    model = base_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sampler = ElasticSampler(1024, global_batch=GLOBAL_BATCH)
    guard = AccelerateGuard(accelerator, ckpt, model=model, sampler=sampler, in_place=in_place_enabled())

    def one_step(x, y) -> float:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(guard.model(x), y))
        sampler.advance()
        return timed(optimizer.step)
    return guard, one_step


def stop_step(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def resize_line(record) -> str:
    drain = record.drain  # the change's durable checkpoint: the shrink's drain or the grow's save
    saved = drain.checkpoint_seconds if drain is not None else 0.0
    return json.dumps({"step": record.step, "outcome": record.outcome.value, "world": record.new_world_size,
                       "pause": record.pause_seconds, "save": saved, "phases": record.phases,
                       "started": record.started_at, "pid": os.getpid()}) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    node = os.environ["SPOTGUARD_NODE"]
    read_membership = membership_reader(out / "membership.json")
    if args.framework == "deepspeed":  # as a user's script does, before it joins (the joiner's warm-up reads it)
        import deepspeed  # noqa: F401
    init_process_group(memberships=read_membership, join_timeout=120)
    boundary = None
    if args.dim:
        adapter, one_step = sized_job(args.ckpt, args.dim, args.layers)
    elif args.framework == "deepspeed":
        adapter, one_step = deepspeed_job(args.ckpt)
    elif args.framework == "accelerate":
        accelerate, one_step = accelerate_job(args.ckpt)
        adapter, guard, boundary = accelerate.adapter, accelerate.guard, accelerate.step
    else:
        adapter, one_step = torch_job(args.framework, args.ckpt)
    if boundary is None:
        guard = Guard.from_env(adapter=adapter)
        boundary = guard.step
    if guard.view is not None:
        watch_memberships(read_membership, guard.view)
    start = guard.resume()
    stop_at, prepared = None, False
    with open(out / f"steps-{node}.jsonl", "a", buffering=1) as steps:
        for step in range(start, args.max_steps):
            optimizer = one_step(*batch(step, guard.rank, guard.world_size))
            time.sleep(args.step_sleep)
            steps.write(json.dumps({"step": step, "t": time.monotonic(), "wall": time.time(),
                                    "world": guard.world_size, "pid": os.getpid(), "optimizer": optimizer}) + "\n")
            stop_at = stop_step(out / "stop-at") if stop_at is None else stop_at
            if stop_at is not None and step >= stop_at:
                break
            result = boundary(step)  # a drain exits 83 here; an in-place change returns in the new group
            if args.dim and not prepared:  # the snapshot buffers, before any notice (a resize re-shards)
                adapter.prepare()
            prepared = not result.resized
            if result.resized:
                with open(out / f"resize-{node}.jsonl", "a") as f:
                    f.write(resize_line(result.resize))
    guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
