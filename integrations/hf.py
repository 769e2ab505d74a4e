"""spotguard for the Hugging Face Trainer: one callback.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    SpotguardCallback.attach(trainer)                 # the one line
    trainer.train(resume_from_checkpoint=True if has_checkpoint else None)

Contract:
- `attach(trainer, **guard_options)` checks the transformers version (UnsupportedFramework
  naming the versions needed) and adds the callback; `guard_options` go to the Guard.
- `on_train_begin` (every rank, the model already wrapped in DDP): makes the Guard, which
  piggybacks its agreement on DDP's gradient all_reduce; removes staging leftovers of a crash.
- `on_step_end`: `guard.step(state.global_step)`. On an agreed notice every rank saves the
  Trainer's own checkpoint (`Trainer._save_checkpoint`: model, optimizer, scheduler, RNG, trainer
  state) of that global step, then the run drains (exit 83, 84 when the save failed) from inside
  the callback. The save runs inside the Guard's drain rather than later through
  `control.should_save`, so a rank whose save fails is known to every rank (exit 84) instead of
  leaving the others waiting; the checkpoint is the same one `should_save` writes.
- Complete or invisible: the Trainer writes into `<output_dir>/.spotguard-staging/checkpoint-N`
  (invisible to `get_last_checkpoint`), then rank 0 fsyncs it, adds `spotguard.json` and renames
  it to `<output_dir>/checkpoint-N`, so `trainer.train(resume_from_checkpoint=True)` resumes from
  it unchanged, at any world size the Trainer supports.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from spotguard.hooks import Guard
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkSave, guard_for, publish_dir, read_marker, remove_quietly
from spotguard.wire.notice import Notice

STAGING = ".spotguard-staging"


class TrainerSave(FrameworkSave):
    """The Trainer's own checkpoint, staged then renamed into `output_dir` (module docstring)."""

    def __init__(self, trainer: Any):
        super().__init__()
        self.trainer = trainer
        self.output_dir = Path(trainer.args.output_dir)
        self.staging = self.output_dir / STAGING
        if self.rank == 0:
            remove_quietly(self.staging)  # a crashed save's leftovers: never visible, now gone
        self.collectives.all_ok(True)  # nobody writes into staging before it is clean

    def _write(self, step: int, notice: Notice | None) -> None:
        args = self.trainer.args
        args.output_dir = str(self.staging)
        try:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
        finally:
            args.output_dir = str(self.output_dir)

    def _publish(self, step: int, notice: Notice | None) -> None:
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        publish_dir(self.staging / name, self.output_dir / name, step, notice)
        remove_quietly(self.staging)

    def _discard(self, step: int) -> None:
        remove_quietly(self.staging)

    def answered_notice_id(self) -> str | None:
        last = get_last_checkpoint(str(self.output_dir)) if self.output_dir.is_dir() else None
        return read_marker(last).get("notice_id")

    def gradient_carrier(self) -> Any:
        import torch

        model = self.trainer.model_wrapped
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class SpotguardCallback(TrainerCallback):
    """See the module docstring."""

    def __init__(self, trainer: Any, **guard_options: Any):
        versions.require("transformers", "spotguard.integrations.hf")
        self.trainer = trainer
        self.guard_options = guard_options
        self.guard: Guard | None = None
        self.adapter: TrainerSave | None = None

    @classmethod
    def attach(cls, trainer: Any, **guard_options: Any) -> SpotguardCallback:
        """The one line: checks the version and adds the callback to `trainer`."""
        callback = cls(trainer, **guard_options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        if self.guard is None:
            self.adapter = TrainerSave(self.trainer)
            self.guard = guard_for(self.adapter, **self.guard_options)
            self.guard.resume()  # the notice the resumed checkpoint answered is not acted on again

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is not None and self.guard.step(state.global_step):
            control.should_training_stop = True  # exit_on_drain=False: the Trainer stops after the drain

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None:
            self.guard.close()
            self.guard = None
