"""The reference Lightning script with spotguard (one line: `SpotguardCallback()` in `callbacks`).

    torchrun --nproc-per-node=2 -m spotguard.trainer.train_lightning --ckpt /ckpt --out /out --steps 24

Resumes with `fit(ckpt_path="last")`. The loader is stateful (`state_dict` / `load_state_dict`,
its position counted in global samples), so Lightning restores the mid-epoch data position at any
world size; the global batch is the same at every world size. Records: `trainer.framework_refs`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spotguard.integrations.lightning import SpotguardCallback
from spotguard.trainer.framework_refs import (GLOBAL_BATCH, DryRunEvents, Records, Samples, TinyRegression,
                                              fail_rank0_saves, parse_args, world)


class ResumableBatches:
    """Batches of this rank's share of each global batch, in a fixed order, resumable: its state is
    the number of global samples consumed (so it means the same at any world size)."""

    def __init__(self, rank: int, size: int):
        self.data, self.rank, self.size = Samples(), rank, size
        self.consumed = 0  # global samples, across epochs

    def __len__(self) -> int:
        return len(self.data) // GLOBAL_BATCH

    def __iter__(self):
        """The rest of the current epoch, from the position held."""
        per_rank = GLOBAL_BATCH // self.size
        start = self.consumed % len(self.data)
        for offset in range(start, len(self.data) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            lo = offset + self.rank * per_rank
            self.consumed += GLOBAL_BATCH
            yield torch.utils.data.default_collate([self.data[i] for i in range(lo, lo + per_rank)])

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


class Module(pl.LightningModule):
    def __init__(self, records: Records, events: DryRunEvents, steps: int, step_sleep: float):
        super().__init__()  # step_sleep: in the model's forward
        self.model, self.records, self.events, self.steps = TinyRegression(step_sleep), records, events, steps

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.records.progress(self.trainer.global_step, self.model.take_ids())
        self.events.step(self.trainer.global_step)

    def on_train_start(self):
        self.records.optimizer = self.trainer.optimizers[0]
        self.records.resumed(self.trainer.global_step, self.trainer.optimizers[0])
        self.events.start(self.trainer.global_step, self.model, self.trainer.optimizers[0])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / self.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    spotguard = SpotguardCallback()
    trainer = pl.Trainer(accelerator="cpu", devices=size, num_nodes=1, strategy="ddp" if size > 1 else "auto",
                         max_steps=opts.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(dirpath=opts.ckpt, save_last=True, save_top_k=0), spotguard,
                                    RecordReclaims(spotguard, records, events)])
    if opts.fail_save:
        fail_rank0_saves(rank, opts.ckpt)
    module = Module(records, events, opts.steps, opts.step_sleep)
    resume = "last" if (Path(opts.ckpt) / "last.ckpt").exists() else None
    trainer.fit(module, ResumableBatches(rank, size), ckpt_path=resume)
    events.finished(trainer.global_step)
    records.final(module.model)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    sys.exit(main())
