"""Host memory over repeated in-place rebuilds of a DeepSpeed engine in one process (DeepSpeed #7204:
an engine made again in a live process leaked the one before).

    .venv/bin/python bench/deepspeed_rebuild_memory.py [--cycles 10] [--dim 1024] [--layers 8]

One process, world size 1 (gloo), ZeRO-2 with a client AdamW over an MLP of `--layers` square
Linear layers of `--dim` (default ~32 MiB of parameters; ~128 MiB with the fp32 master and Adam
moments). A cycle is what a survivor does in a change: its partitions collected as reshard pieces
(copied, as the transfer's new pieces are), the default group destroyed and formed again, the
engine made again with `deepspeed_zero.reinitialize` and the pieces installed, then one training
step. The RSS after each cycle is printed; the goal (issue 39): after the tenth within 5% of after
the first. `--no-release` makes the engine again without releasing the old one (only dropping the
adapter's reference, as a plain second `deepspeed.initialize` would), for comparison.
"""
from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group() -> None:
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--no-release", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    from spotguard.hooks.adapters.deepspeed import config_at
    from spotguard.hooks.adapters.deepspeed_zero import _drop_cached_groups, collect, install, reinitialize

    group()
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=config)[0]
    x = torch.randn(4, args.dim)

    def train() -> None:
        engine.backward(engine(x).square().mean())
        engine.step()

    train()
    print(f"steady: {rss_mib():.0f} MiB ({'old engine kept' if args.no_release else 'old engine released'})")
    after = []
    for cycle in range(1, args.cycles + 1):
        shards = collect(engine)
        manifest, pieces = shards.manifest, {i: piece.clone() for i, piece in enumerate(shards.pieces)}
        del shards
        dist.destroy_process_group()
        group()
        if args.no_release:
            _drop_cached_groups()
            engine = deepspeed.initialize(model=engine.module, optimizer=torch.optim.AdamW(
                engine.module.parameters(), lr=1e-3), config=config_at(engine, 1))[0]
        else:
            engine = reinitialize(engine, config_at(engine, 1))
        install(engine, manifest, pieces)
        del pieces
        train()
        gc.collect()
        after.append(rss_mib())
        print(f"after cycle {cycle:2d}: {after[-1]:.0f} MiB")
    growth = (after[-1] - after[0]) / after[0]
    print(f"after the tenth vs the first: {growth * 100:+.1f}% ({'met' if growth <= 0.05 else 'MISSED'}: goal <= 5%)"
          if len(after) >= 10 else f"growth {growth * 100:+.1f}%")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
