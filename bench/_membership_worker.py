"""One host's training process for bench/membership_change.py (one rank per host).

    python bench/_membership_worker.py --framework ddp|fsdp2|deepspeed --ckpt DIR --out DIR

The job of `spotguard.trainer.elastic_job` (DeepSpeed: the same model under ZeRO-1), with a
synthetic compute time per step (`--step-sleep`). The environment is the launcher's: torchrun's
variables, plus spotguard launch's in-place ones for the in-place path (then memberships are
pushed by writing `<out>/membership.json`). Without SPOTGUARD_IN_PLACE the Guard drains on a
notice as today: every rank checkpoints the agreed step and exits 83.

Files written into --out, appended to by every process that runs as host SPOTGUARD_NODE:
- steps-<node>.jsonl: {"step", "t" (time.monotonic(), the same clock in every process of the
  machine), "world", "pid"} once each step is complete, before the Guard's boundary;
- resize-<node>.jsonl: one line per in-place change, the Guard's record ("pause", "phases")
  plus "save", the seconds of the shrink's durable checkpoint before it.
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

FRAMEWORKS = ("ddp", "fsdp2", "deepspeed")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=100_000)
    return p.parse_args(argv)


def torch_job(framework: str, ckpt: str):
    """(adapter, one_step(x, y)) for DDP / FSDP2 through the DCP adapter, resizable in place."""
    from spotguard.hooks.adapters.torch_dcp import TorchDCPAdapter

    build = build_for(framework)
    model, optimizer = build()
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir=ckpt, build=build)

    def one_step(x, y) -> None:
        adapter.optimizer.zero_grad()
        torch.nn.functional.mse_loss(adapter.model(x), y).backward()
        adapter.optimizer.step()
    return adapter, one_step


def deepspeed_job(ckpt: str):
    """(adapter, one_step(x, y)) for DeepSpeed ZeRO-1 (restart path only: not resizable)."""
    import deepspeed

    from spotguard.hooks.adapters.deepspeed import DeepSpeedAdapter
    from spotguard.trainer.elastic_job import GLOBAL_BATCH

    model = base_model()
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    config = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1,
              "train_batch_size": per_rank * dist.get_world_size(), "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                           config=config)

    def one_step(x, y) -> None:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return DeepSpeedAdapter(engine, checkpoint_dir=ckpt), one_step


def stop_step(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def resize_line(guard: Guard, record) -> str:
    drain = guard.last_drain
    saved = drain.checkpoint_seconds if drain is not None and drain.step == record.step else 0.0
    return json.dumps({"step": record.step, "outcome": record.outcome.value, "world": record.new_world_size,
                       "pause": record.pause_seconds, "save": saved, "phases": record.phases,
                       "pid": os.getpid()}) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    node = os.environ["SPOTGUARD_NODE"]
    read_membership = membership_reader(out / "membership.json")
    init_process_group(memberships=read_membership, join_timeout=120)
    if args.framework == "deepspeed":
        adapter, one_step = deepspeed_job(args.ckpt)
    else:
        adapter, one_step = torch_job(args.framework, args.ckpt)
    guard = Guard.from_env(adapter=adapter)
    if guard.view is not None:
        watch_memberships(read_membership, guard.view)
    start = guard.resume()
    stop_at = None
    with open(out / f"steps-{node}.jsonl", "a", buffering=1) as steps:
        for step in range(start, args.max_steps):
            one_step(*batch(step, guard.rank, guard.world_size))
            time.sleep(args.step_sleep)
            steps.write(json.dumps({"step": step, "t": time.monotonic(), "world": guard.world_size,
                                    "pid": os.getpid()}) + "\n")
            stop_at = stop_step(out / "stop-at") if stop_at is None else stop_at
            if stop_at is not None and step >= stop_at:
                break
            result = guard.step(step)  # a drain exits 83 here; an in-place change returns in the new group
            if result.resized:
                with open(out / f"resize-{node}.jsonl", "a") as f:
                    f.write(resize_line(guard, result.resize))
    guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
