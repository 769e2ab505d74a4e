"""The reference Accelerate script with spotguard (one line: `AccelerateGuard(...)`).

    torchrun --nproc-per-node=2 -m spotguard.trainer.train_accelerate --ckpt /ckpt --out /out --steps 24
    ... --deepspeed-stage 2      # through Accelerate's DeepSpeed plugin (ZeRO-1/2 run on CPU)

The data is dealt out by `spotguard.data.ElasticSampler` (`--keep-batch global`: the global batch
is 8 at every world size, per-device batch = 8 / world size; `rank`: 4 per device), its
position saved with every `save_state`. Records: `trainer.framework_refs`.
"""
from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedDataParallelKwargs

from spotguard.integrations.accelerate import AccelerateGuard
from spotguard.trainer.framework_refs import (DryRunEvents, Records, Samples, TinyRegression, base_optimizer,
                                              fail_rank0_saves, parse_args, sampler_for, world)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args("spotguard.trainer.train_accelerate", argv)
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
    model = TinyRegression(opts.step_sleep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / opts.steps))
    data = Samples()
    sampler = sampler_for(data, opts)
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


if __name__ == "__main__":
    sys.exit(main())
