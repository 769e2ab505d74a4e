"""The reference Hugging Face Trainer script with spotguard (one line: `SpotguardCallback.attach`).

    spotguard launch --standalone --nproc-per-node=2 -m spotguard.trainer.train_hf --ckpt /ckpt --out /out --steps 24
    ... --deepspeed-stage 2      # the same through the Trainer's DeepSpeed integration (ZeRO-1/2 run on CPU)

The data is dealt out by `spotguard.data.ElasticSampler` (`SpotguardCallback.attach(trainer,
sampler=...)`): the global batch is 8 at every world size (per-device batch = 8 / world size;
`--keep-batch rank`: 4 per device), and a resume at any world size continues the order.
Records: `trainer.framework_refs`.
"""
from __future__ import annotations

import sys

from transformers import Trainer, TrainerCallback, TrainingArguments

from spotguard.integrations.hf import SpotguardCallback, last_checkpoint
from spotguard.trainer.framework_refs import (DryRunEvents, Records, Samples, SlowEval, TinyRegression,
                                              base_optimizer, fail_rank0_saves, parse_args, sampler_for, world)


def deepspeed_config(stage: int) -> dict:
    """ZeRO stage `stage` for the Trainer's DeepSpeed integration; the batch sizes come from the Trainer."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True}


class RecordSteps(TrainerCallback):
    def __init__(self, records: Records, model: TinyRegression, events: DryRunEvents, *, unwrap: bool = False,
                 snapshot_every: int = 0):
        self.records, self.model, self.events, self.unwrap = records, model, events, unwrap
        self.snapshot_every = snapshot_every

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.unwrap:
            optimizer = base_optimizer(optimizer)
        self.records.optimizer = optimizer
        self.records.resumed(state.global_step, optimizer)
        self.events.start(state.global_step, self.model, optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self.records.progress(state.global_step, self.model.take_ids())
        self.records.snapshot_step(state.global_step, self.snapshot_every)
        self.events.step(state.global_step)


def evaluation(opts) -> dict:
    """TrainingArguments of `--eval-every` (none without it)."""
    if not opts.eval_every:
        return {}
    return {"eval_strategy": "steps", "eval_steps": opts.eval_every, "per_device_eval_batch_size": 4,
            "prediction_loss_only": True}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args("spotguard.trainer.train_hf", argv)
    rank, size = world()
    records = Records(opts.out, rank)
    events = DryRunEvents(opts, rank, size)
    data = Samples()
    sampler = sampler_for(data, opts)
    per_device = sampler.geometry(size).global_size // size
    args = TrainingArguments(output_dir=opts.ckpt, per_device_train_batch_size=per_device,
                             max_steps=opts.steps, learning_rate=1e-2, lr_scheduler_type="linear",
                             save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, remove_unused_columns=False, seed=7,
                             ignore_data_skip=True,
                             ddp_backend="gloo" if size > 1 else None, disable_tqdm=True,
                             deepspeed=deepspeed_config(opts.deepspeed_stage) if opts.deepspeed_stage else None,
                             **evaluation(opts))
    model = TinyRegression(opts.step_sleep)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      eval_dataset=SlowEval(opts.out, rank, opts.eval_seconds) if opts.eval_every else None)
    # RecordSteps ahead of spotguard's callback: the step a notice drains at is recorded too
    trainer.add_callback(RecordSteps(records, model, events, unwrap=bool(opts.deepspeed_stage),
                                     snapshot_every=opts.integration_snapshot_every))
    snapshots = {"snapshot_every": opts.integration_snapshot_every} if opts.integration_snapshot_every else {}
    callback = SpotguardCallback.attach(trainer, sampler=sampler, **snapshots)
    if opts.fail_save:
        fail_rank0_saves(rank, opts.ckpt)
    trainer.add_callback(_OnReclaim(callback, records, events))
    trainer.train(resume_from_checkpoint=last_checkpoint(trainer))
    events.finished(trainer.state.global_step)
    records.final(model)
    return 0


class _OnReclaim(TrainerCallback):
    """Registers the records' @on_reclaim hook once the Guard exists (on_train_begin)."""

    def __init__(self, callback: SpotguardCallback, records: Records, events: DryRunEvents):
        self.callback, self.records, self.events = callback, records, events

    def on_train_begin(self, args, state, control, **kwargs):
        if self.callback.guard is not None:
            self.records.adapter = self.callback.adapter
            self.callback.guard.on_reclaim(self.records.saved)
            self.events.attach(self.callback.guard, self.callback.adapter)


if __name__ == "__main__":
    sys.exit(main())
