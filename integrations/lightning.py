"""spotguard for PyTorch Lightning: one callback.

    trainer = L.Trainer(..., callbacks=[ModelCheckpoint(dirpath="/ckpt", save_last=True), SpotguardCallback()])
    trainer.fit(model, loader, ckpt_path="last")

Contract:
- Made anywhere (it checks the lightning version at once: UnsupportedFramework naming the
  versions needed); `guard_options` go to the Guard.
- `on_train_start` (every rank, the model already wrapped in DDP): makes the Guard, which
  piggybacks its agreement on DDP's gradient all_reduce. Its SIGTERM handler replaces
  Lightning's for the fit (Lightning's stops the loop and saves nothing, and broadcasts from inside
  the handler of the one rank that got the signal): SIGTERM becomes a notice, as with the Guard.
- `on_train_batch_end`, after each optimizer step: `guard.step(trainer.global_step)`. On an agreed
  notice every rank calls `trainer.save_checkpoint` for that global step (Lightning's own format),
  then `trainer.should_stop` is set and the run drains (exit 83; 84 when the save failed).
- Complete or invisible: the checkpoint is written to `<dirpath>/.last.ckpt.spotguard-tmp`, then
  rank 0 fsyncs it and renames it onto `<dirpath>/last.ckpt` (one atomic rename), where
  `fit(ckpt_path="last")` finds it. `dirpath` is the ModelCheckpoint's (or the `dirpath` given here).
- Data position: Lightning restores a mid-epoch position only for dataloaders with
  `state_dict`/`load_state_dict` (its rule); use one whose state is in global samples so a resume
  at another world size continues where the run stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from spotguard.config import ConfigError
from spotguard.hooks import Guard
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkSave, guard_for, publish_file, remove_quietly
from spotguard.wire.notice import Notice

STAGED_NAME = ".last.ckpt.spotguard-tmp"


class LightningSave(FrameworkSave):
    """`trainer.save_checkpoint` to a staged file, renamed onto `last.ckpt` (module docstring)."""

    def __init__(self, trainer: Any, dirpath: str | None):
        super().__init__()
        self.trainer = trainer
        self.dirpath = Path(dirpath)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self.staged = self.dirpath / STAGED_NAME
        self.final = self.dirpath / "last.ckpt"

    def _write(self, step: int, notice: Notice | None) -> None:
        self.trainer.save_checkpoint(str(self.staged))

    def _rejoin_after_failure(self) -> None:
        self.trainer.strategy.barrier("spotguard.save_failed")  # the barrier save_checkpoint ends with

    def _publish(self, step: int, notice: Notice | None) -> None:
        publish_file(self.staged, self.final)

    def _discard(self, step: int) -> None:
        remove_quietly(self.staged)

    def gradient_carrier(self) -> Any:
        import torch

        model = self.trainer.strategy.model
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class SpotguardCallback(pl.Callback):
    """See the module docstring."""

    def __init__(self, dirpath: str | None = None, **guard_options: Any):
        versions.require("lightning", "spotguard.integrations.lightning")
        self.dirpath = dirpath
        self.guard_options = guard_options
        self.guard: Guard | None = None
        self.adapter: LightningSave | None = None
        self._last_step = -1

    def _checkpoint_dir(self, trainer: Any) -> str:
        dirpath = self.dirpath or getattr(trainer.checkpoint_callback, "dirpath", None)
        if not dirpath:
            raise ConfigError("dirpath", "needs a ModelCheckpoint(dirpath=..., save_last=True) or "
                              "SpotguardCallback(dirpath=...)")
        return str(dirpath)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.guard is None:
            self.adapter = LightningSave(trainer, self._checkpoint_dir(trainer))
            self.guard = guard_for(self.adapter, **self.guard_options)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.guard is None or step == self._last_step:  # mid gradient accumulation: not a step boundary
            return
        self._last_step = step
        if self.guard.step(step):
            trainer.should_stop = True  # exit_on_drain=False: Lightning stops after the drain

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SystemExit):
            self.close()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
