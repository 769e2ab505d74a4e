"""spotguard for PyTorch Lightning: one callback.

    sampler = ElasticSampler(dataset, global_batch=32, micro_batch=8)        # optional: the data position
    loader = DataLoader(dataset, batch_sampler=sampler)
    checkpoints = ModelCheckpoint(dirpath="/ckpt", save_last=True)
    trainer = L.Trainer(..., use_distributed_sampler=False, accumulate_grad_batches=sampler.micro_batches_per_step(),
                        callbacks=[checkpoints, SpotguardCallback(sampler=sampler)])
    trainer.fit(model, loader, ckpt_path="last")

Launch with `spotguard launch` (torchrun's flags), which exits 83 when every rank drained; torchrun
reports any worker's non-zero exit as its own exit 1.

Contract:
- Made anywhere (it checks the lightning version at once: UnsupportedFramework naming the
  versions needed); `guard_options` go to the Guard (`snapshot_every=N`: an in-memory snapshot
  every N steps, for a notice during validation: core.py).
- `on_train_start` (every rank, the model already wrapped in DDP): makes the Guard, which
  piggybacks its agreement on DDP's gradient all_reduce. Its SIGTERM handler replaces
  Lightning's for the fit (Lightning's stops the loop and saves nothing, and broadcasts from inside
  the handler of the one rank that got the signal): SIGTERM becomes a notice, as with the Guard.
- `on_train_batch_end`, after each optimizer step: `guard.step(trainer.global_step)` (its first
  boundary allocates the snapshot engine's buffers: `prepare()`). On an agreed
  notice every rank saves that global step through the one engine (core.py): at the step boundary
  `trainer.save_checkpoint` runs (Lightning's own checkpoint dict: weights, optimizer and scheduler
  states, loops, callbacks, hyper-parameters) with the strategy's CheckpointIO swapped for one whose
  `torch.save` is captured, and the engine copies its tensors into its buffers; the engine then
  writes `last.ckpt` (Lightning's format: one `torch.save` file) in the background; then
  `trainer.should_stop` is set and the run drains (exit 83; 84 when the save failed).
- Complete or invisible: the checkpoint store's root is `dirpath`; the checkpoint is committed as
  `<dirpath>/step-<N, 9 digits>-notice/last.ckpt` (`step-000000112-notice/last.ckpt`, with the
  store's manifest), then rank 0 hard-links it onto
  `<dirpath>/last.ckpt` (a temporary name renamed into place: one atomic rename), where
  `fit(ckpt_path="last")` finds it. `dirpath` is the ModelCheckpoint's (or the `dirpath` given
  here). Lightning replaces `last.ckpt` by a rename when it saves it itself, so the committed copy
  behind the link is never overwritten.
- Why `.ckpt` and not the engine's sharded layout: `fit(ckpt_path=...)`,
  `LightningModule.load_from_checkpoint` and Lightning's tools read one `torch.save` file.
- Data position, with `sampler=` (a `spotguard.data.ElasticSampler`, the loader made with
  `batch_sampler=sampler` and `Trainer(use_distributed_sampler=False)`, so Lightning leaves the
  dealing to it): the callback's `state_dict()` is the sampler's position, so every Lightning
  checkpoint holds it (Lightning's own saves and spotguard's) and `fit(ckpt_path=...)` restores it
  before the first batch; each optimizer step advances it by one global batch. `on_train_start`
  raises when the train loader does not draw from it, when `accumulate_grad_batches` is not its
  `micro_batches_per_step()`, and when the resumed global step is not its position's
  (DataPositionError). Every sample is then seen once per epoch at any world size. Without
  `sampler=`, Lightning restores a mid-epoch position only for loaders with
  `state_dict`/`load_state_dict` (its rule), exact at another world size only when that state
  means the same there.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from spotguard.config import ConfigError
from spotguard.data import ElasticSampler
from spotguard.hooks import Guard
from spotguard.hooks.checkpoint.objectstore.url import is_object_store_url
from spotguard.hooks.adapters.store import CheckpointInfo
from spotguard.hooks.checkpoint import fsutil
from spotguard.hooks.checkpoint.manifest import TRASH_PREFIX, aside_name
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkAdapter, find_in_loader, guard_for, warn_stateless_stream

LAST = "last.ckpt"
STAGED_LINK = ".last.ckpt.spotguard-tmp"


class _CapturedIO(CheckpointIO):
    """Lightning's CheckpointIO during a spotguard save: `torch.save` to the path, which the capture records."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        torch.save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
        raise NotImplementedError

    def remove_checkpoint(self, path: Any) -> None:
        raise NotImplementedError


class LightningSave(FrameworkAdapter):
    """Lightning's checkpoint through the snapshot engine, published as `<dirpath>/last.ckpt` (module docstring)."""

    def __init__(self, trainer: Any, dirpath: str | os.PathLike):
        if is_object_store_url(dirpath):
            raise ConfigError("dirpath", f"{dirpath}: the Lightning integration needs a local dirpath (Lightning's "
                              "fit(ckpt_path=\"last\") reads <dirpath>/last.ckpt); an s3:// one is not supported yet")
        self.trainer = trainer
        super().__init__(dirpath)
        self.final = self.store.root / LAST

    def _framework_save(self, root: Path, step: int) -> None:
        strategy = self.trainer.strategy
        kept = strategy.checkpoint_io
        strategy.checkpoint_io = _CapturedIO()
        try:
            # The whole checkpoint, said explicitly: Lightning logs "`weights_only` was not set" when left out.
            self.trainer.save_checkpoint(str(root / LAST), weights_only=False)
        finally:
            strategy.checkpoint_io = kept

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Rank 0: `<dirpath>/last.ckpt` becomes the committed file (a hard link, or a copy where the
        file system has none), atomically. The file it replaces is freed after that, behind the
        commit on the engine's writer thread: freeing a large file is not part of making the new
        one durable (`_set_aside`)."""
        staged = self.store.root / STAGED_LINK
        staged.unlink(missing_ok=True)
        try:
            os.link(info.dir / LAST, staged)
        except OSError:
            shutil.copyfile(info.dir / LAST, staged)
            fsutil.fsync_path(staged)
        replaced = self._set_aside(self.final)
        os.replace(staged, self.final)
        fsutil.fsync_dir(self.store.root)
        if replaced is not None and self.snapshot_engine is not None:
            self.snapshot_engine.submit(lambda: replaced.unlink(missing_ok=True))
        elif replaced is not None:
            replaced.unlink(missing_ok=True)

    def _set_aside(self, path: Path) -> Path | None:
        """A second name for `path` (`.trash-last.ckpt-<id>` beside it), so replacing `path` drops
        a name instead of freeing the file inside the commit (ext4 frees a 500 MB file in
        0.3-0.4 s, more with the `discard` mount option); None when there is no `path` or no hard
        link. A name left by a crash is removed by the store's cleanup at the next open."""
        aside = self.store.root / aside_name(TRASH_PREFIX, path.name)
        try:
            os.link(path, aside, follow_symlinks=False)
        except OSError:  # no file there yet, or no hard links on this file system
            return None
        return aside

    def resume(self) -> int | None:
        """Lightning resumes itself (`fit(ckpt_path="last")`); nothing is loaded here."""
        return None

    def gradient_carrier(self) -> Any:
        model = self.trainer.strategy.model
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class SpotguardCallback(pl.Callback):
    """See the module docstring."""

    def __init__(self, dirpath: str | None = None, *, sampler: ElasticSampler | None = None, **guard_options: Any):
        versions.require("lightning", "spotguard.integrations.lightning")
        self.dirpath = dirpath
        self.sampler = sampler
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

    def state_dict(self) -> dict[str, Any]:
        """What Lightning keeps in every checkpoint for this callback: the sampler's position."""
        return {"data": self.sampler.state_dict()} if self.sampler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.sampler is not None and "data" in state_dict:
            self.sampler.load_state_dict(state_dict["data"])

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sampler is not None:
            self._check_data(trainer, self.sampler)
        else:
            warn_stateless_stream(trainer.train_dataloader, "the Lightning SpotguardCallback")
        if self.guard is None:
            self.adapter = LightningSave(trainer, self._checkpoint_dir(trainer))
            self.guard = guard_for(self.adapter, **self.guard_options)
        self._last_step = trainer.global_step

    @staticmethod
    def _check_data(trainer: Any, sampler: ElasticSampler) -> None:
        if find_in_loader(trainer.train_dataloader, ElasticSampler) is not sampler:
            raise ConfigError("sampler", "the train loader does not draw from it: make it "
                              "DataLoader(dataset, batch_sampler=sampler) with Trainer(use_distributed_sampler=False)")
        if trainer.accumulate_grad_batches != sampler.micro_batches_per_step():
            raise ConfigError("accumulate_grad_batches", f"is {trainer.accumulate_grad_batches}, but a step of the "
                              f"sampler is {sampler.micro_batches_per_step()} micro-batches at this world size: "
                              "Trainer(accumulate_grad_batches=sampler.micro_batches_per_step())")
        sampler.check_position(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.guard is None or step == self._last_step:  # mid gradient accumulation: not a step boundary
            return
        self._last_step = step
        if self.sampler is not None:
            self.sampler.advance()  # this step's global batch is consumed: a save at this boundary holds that
        if self.guard.step(step):
            # Reached only with SpotguardCallback(exit_on_drain=False): by default the Guard ends the
            # process after the drain (83, 84 if the save failed) inside step(). Here Lightning stops.
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not isinstance(exception, SystemExit):
            self.close()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
