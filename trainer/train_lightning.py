"""The reference Lightning script with spotguard (one line: `SpotguardCallback()` in `callbacks`).

    torchrun --nproc-per-node=2 -m spotguard.trainer.train_lightning --ckpt /ckpt --out /out --steps 24

Resumes with `fit(ckpt_path="last")`. The data is dealt out by `spotguard.data.ElasticSampler`
(`SpotguardCallback(sampler=...)`: its position in every Lightning checkpoint), so the data
continues where the run stopped at any world size (`--keep-batch`: the global batch kept, or
each rank's). Records: `trainer.framework_refs`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spotguard.integrations.lightning import SpotguardCallback
from spotguard.trainer.framework_refs import (DryRunEvents, Records, Samples, SlowEval, TinyRegression,
                                              fail_rank0_saves, parse_args, sampler_for, world)


class Module(pl.LightningModule):
    def __init__(self, records: Records, events: DryRunEvents, steps: int, step_sleep: float):
        super().__init__()  # step_sleep: in the model's forward
        self.model, self.records, self.events, self.steps = TinyRegression(step_sleep), records, events, steps

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def on_train_start(self):
        self.records.optimizer = self.trainer.optimizers[0]
        self.records.resumed(self.trainer.global_step, self.trainer.optimizers[0])
        self.events.start(self.trainer.global_step, self.model, self.trainer.optimizers[0])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / self.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Validated(Module):
    """`Module` with a validation step (`--eval-every`; Lightning warns about one without a loader)."""

    def validation_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]


class RecordSteps(pl.Callback):
    """Records each step; ahead of SpotguardCallback in `callbacks`, so the step a notice drains at is
    recorded too (Lightning calls callbacks before the module's own hooks)."""

    def __init__(self, module: Module, snapshot_every: int = 0):
        self.module, self.snapshot_every = module, snapshot_every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.module.records.progress(trainer.global_step, self.module.model.take_ids())
        self.module.records.snapshot_step(trainer.global_step, self.snapshot_every)
        self.module.events.step(trainer.global_step)


class RecordReclaims(pl.Callback):
    def __init__(self, spotguard: SpotguardCallback, records: Records, events: DryRunEvents):
        self.spotguard, self.records, self.events = spotguard, records, events

    def on_train_start(self, trainer, pl_module):
        self.records.adapter = self.spotguard.adapter
        self.spotguard.guard.on_reclaim(self.records.saved)
        self.events.attach(self.spotguard.guard, self.spotguard.adapter)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args("spotguard.trainer.train_lightning", argv)
    rank, size = world()
    records = Records(opts.out, rank)
    events = DryRunEvents(opts, rank, size)
    data = Samples()
    sampler = sampler_for(data, opts)
    every = opts.integration_snapshot_every
    spotguard = SpotguardCallback(sampler=sampler, **({"snapshot_every": every} if every else {}))
    module = (Validated if opts.eval_every else Module)(records, events, opts.steps, opts.step_sleep)
    validation = {"val_check_interval": opts.eval_every, "check_val_every_n_epoch": None} if opts.eval_every else {}
    trainer = pl.Trainer(accelerator="cpu", devices=size, num_nodes=1, strategy="ddp" if size > 1 else "auto",
                         max_steps=opts.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0,
                         accumulate_grad_batches=sampler.micro_batches_per_step(size), **validation,
                         callbacks=[ModelCheckpoint(dirpath=opts.ckpt, save_last=True, save_top_k=0),
                                    RecordSteps(module, every), spotguard, RecordReclaims(spotguard, records, events)])
    if opts.fail_save:
        fail_rank0_saves(rank, opts.ckpt)
    resume = "last" if (Path(opts.ckpt) / "last.ckpt").exists() else None
    val = (torch.utils.data.DataLoader(SlowEval(opts.out, rank, opts.eval_seconds), batch_size=4)
           if opts.eval_every else None)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_sampler=sampler), val, ckpt_path=resume)
    events.finished(trainer.global_step)
    records.final(module.model)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    sys.exit(main())
