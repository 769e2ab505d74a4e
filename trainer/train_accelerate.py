"""The reference Accelerate script with spotguard (one line: `AccelerateGuard(...)`).

    torchrun --nproc-per-node=2 -m spotguard.trainer.train_accelerate --ckpt /ckpt --out /out --steps 24
    ... --deepspeed-stage 2      # through Accelerate's DeepSpeed plugin (ZeRO-1/2 run on CPU)

The data is dealt out by `spotguard.data.ElasticSampler` (`--keep-batch global`: the global batch
is 8 at every world size, per-device batch = 8 / world size; `rank`: 4 per device), its
position saved with every `save_state`. Records: `trainer.framework_refs`.

In an in-place job (`SPOTGUARD_IN_PLACE=1`, as `spotguard launch` sets it for one) the script takes
the in-place form (`AccelerateGuard(..., in_place=True)`, `guard.steps`): survivors keep their
processes through a membership change, a joiner (`SPOTGUARD_JOIN=1`) receives the state from a
live peer; `--ledger DIR` records each step's sample ids with the rank and world size it was
trained at. Its records are named by host (`SPOTGUARD_NODE`), as ranks change.
"""
from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs

from spotguard.hooks.elastic.join import elastic_process, in_place_enabled
from spotguard.integrations.accelerate import AccelerateGuard
from spotguard.trainer.framework_refs import (DryRunEvents, Records, Samples, TinyRegression, base_optimizer,
                                              fail_rank0_saves, parse_args, sampler_for, world)


def parts(opts):
    """The script's model, optimizer, schedule, data and sampler (both forms)."""
    model = TinyRegression(opts.step_sleep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / opts.steps))
    data = Samples()
    return model, optimizer, scheduler, data, sampler_for(data, opts)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args("spotguard.trainer.train_accelerate", argv)
    if in_place_enabled() and not opts.deepspeed_stage:
        return main_in_place(opts)
    rank, size = world()
    records = Records(opts.out, rank)
    events = DryRunEvents(opts, rank, size)
    # the schedule steps once per optimizer step at every world size (Accelerate's default steps it once per process)
    if opts.deepspeed_stage:  # on CPU the plugin needs the gloo group made first (as the Trainer does)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(cpu=True)
        accelerator = Accelerator(step_scheduler_with_optimizer=False, deepspeed_plugin=DeepSpeedPlugin(
            zero_stage=opts.deepspeed_stage, gradient_accumulation_steps=1))
    else:
        accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False,
                                  kwargs_handlers=[DistributedDataParallelKwargs()])
    model, optimizer, scheduler, data, sampler = parts(opts)
    loader = torch.utils.data.DataLoader(data, batch_size=sampler.geometry(size).global_size // size,
                                         sampler=sampler.global_order())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = AccelerateGuard(accelerator, opts.ckpt, model=model, sampler=sampler)
    records.adapter = guard.adapter
    guard.guard.on_reclaim(records.saved)
    events.attach(guard.guard, guard.adapter, offset=1)
    if opts.fail_save:
        fail_rank0_saves(rank, opts.ckpt)
    records.optimizer = base_optimizer(optimizer)
    start = guard.resume()
    records.resumed(start, base_optimizer(optimizer))
    events.start(start, accelerator.unwrap_model(model), base_optimizer(optimizer))
    inner = accelerator.unwrap_model(model)
    for step, batch in guard.batches(loader, start, opts.steps):
        loss = model(**batch)["loss"]
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        records.progress(step + 1, inner.take_ids())
        events.step(step + 1, loss.item())
        guard.step(step)
    guard.close()
    events.finished(opts.steps)
    records.final(inner)
    return 0


def main_in_place(opts) -> int:
    """The in-place form (module docstring): spotguard's group first, the loader not prepared."""
    import json
    from contextlib import nullcontext

    import torch.distributed as dist

    from spotguard.hooks.elastic import init_process_group
    from spotguard.trainer.model import state_digest

    init_process_group()  # a joiner waits here for the membership that admits it
    rank, size = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))  # Accelerate reads the launcher's variables
    records = Records(opts.out, rank, tag=os.environ.get("SPOTGUARD_NODE") or str(rank))
    events = DryRunEvents(opts, rank, size)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False,
                              kwargs_handlers=[DistributedDataParallelKwargs()])
    model, optimizer, scheduler, data, sampler = parts(opts)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    guard = AccelerateGuard(accelerator, opts.ckpt, model=model, sampler=sampler, in_place=True)
    records.adapter = guard.adapter
    events.attach(guard.guard, guard.adapter, offset=1)
    guard.guard.on_resize(lambda record: events.resized(record, offset=1))
    start = guard.resume()
    inner = accelerator.unwrap_model(model)
    process = elastic_process()
    events.start(start, inner, base_optimizer(optimizer), joined=process is not None and process.joined is not None)
    ledger = open(os.path.join(opts.ledger, f"ledger-{os.getpid()}.jsonl"), "a", buffering=1) if opts.ledger else None
    for step, micro in guard.steps(loader, start, opts.steps):
        model = guard.model  # a new DDP after an in-place change
        for i, batch in enumerate(micro):
            with model.no_sync() if i < len(micro) - 1 and hasattr(model, "no_sync") else nullcontext():
                loss = model(**batch)["loss"]
                accelerator.backward(loss / len(micro))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ids = inner.take_ids()
        if ledger is not None:  # with the state after the step: every replica's must be the same
            digest = state_digest(inner.state_dict(), base_optimizer(optimizer).state_dict()["state"])
            ledger.write(json.dumps({"step": step, "rank": guard.guard.rank, "world": guard.guard.world_size,
                                     "ids": ids, "digest": digest}) + "\n")
        records.progress(step + 1, ids)
        events.step(step + 1, loss.item())
        guard.step(step)
    guard.close()
    events.finished(opts.steps)
    records.rank = guard.guard.rank
    records.final(inner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
