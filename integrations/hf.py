"""spotguard for the Hugging Face Trainer: one callback.

    trainer = Trainer(model=model, args=args, train_dataset=ds)     # args: ignore_data_skip=True with a sampler
    SpotguardCallback.attach(trainer, sampler=ElasticSampler(ds, global_batch=32))   # the one line
    trainer.train(resume_from_checkpoint=last_checkpoint(trainer))   # None on a first run

Launch with `spotguard launch` (torchrun's flags), which exits 83 when every rank drained; torchrun
reports any worker's non-zero exit as its own exit 1.

Contract:
- `attach(trainer, **guard_options)` checks the transformers version (UnsupportedFramework
  naming the versions needed) and adds the callback; `guard_options` go to the Guard
  (`snapshot_every=N`: an in-memory snapshot every N steps, for a notice during evaluation: core.py).
- `on_train_begin` (every rank, the model already wrapped in DDP): makes the Guard, which
  piggybacks its agreement on DDP's gradient all_reduce; the store removes what a killed save
  left (its pending directory, the step-boundary scratch).
- `on_step_end`: `guard.step(state.global_step)` (its first boundary allocates the snapshot
  engine's buffers: `prepare()`). On an agreed notice every rank saves the
  Trainer's own checkpoint of that global step through the one engine (core.py): at the step
  boundary the Trainer's `_save_checkpoint` (model, optimizer, scheduler, RNG, trainer state) runs
  with its `torch.save` / safetensors writes captured, and the captured tensors are copied into
  the engine's buffers; the engine then writes those files, in the Trainer's format, in the
  background, and the run drains (exit 83, 84 when the save failed) from inside the callback.
  The save runs inside the Guard's drain rather than later through `control.should_save`, so a
  rank whose save fails is known to every rank (exit 84) instead of leaving the others waiting.
- `output_dir="s3://bucket/prefix"`: spotguard's checkpoints go to the object store
  (docs/checkpoints.md) and `last_checkpoint` downloads the newest; the Trainer's own periodic
  saves, if any, go where the Trainer writes them.
- Complete or invisible: the checkpoint store's root is `output_dir` and the checkpoint's tag is
  the Trainer's own name `checkpoint-N`: it is written into `<output_dir>/.pending-checkpoint-N`
  (invisible to `get_last_checkpoint`) and renamed to `<output_dir>/checkpoint-N` once every rank
  wrote its part, with the store's manifest (`spotguard-manifest.json`: checksums, the step and the
  notice it answers). `trainer.train(resume_from_checkpoint=last_checkpoint(trainer))` resumes
  from it unchanged, at any world size the Trainer supports (`resume_from_checkpoint=True` raises
  transformers' "No valid checkpoint found" on a first run). The Trainer's own periodic
  checkpoints are untouched.
- `push_to_hub` is off for spotguard's saves (a notice checkpoint is not a model release).
- The data position, with `sampler=` (a `spotguard.data.ElasticSampler`): `attach` makes it the
  Trainer's train sampler (`sampler.global_order()`, through the Trainer's `_get_train_sampler`,
  so Accelerate deals each step's global batch to the ranks) and needs
  `TrainingArguments(ignore_data_skip=True)` (the Trainer's own skip would skip a second time:
  ConfigError otherwise); each optimizer step advances it by one global batch, which must be
  `per_device_train_batch_size x world size x gradient_accumulation_steps` (checked at
  `on_train_begin`). Its position is written beside every checkpoint the Trainer saves, its own
  and spotguard's (`checkpoint-N/spotguard-data.json`, by rank 0), and read back from
  `checkpoint-<global step>` at a resume; a resume without it, or at a step it does not belong
  to, raises (DataPositionError) instead of continuing in another order. Without `sampler=`
  the Trainer keeps the data position itself (exact only with the same global batch and order at
  every world size).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from spotguard.config import ConfigError
from spotguard.data import DataPositionError, ElasticSampler
from spotguard.hooks import Guard
from spotguard.hooks.checkpoint import open_store
from spotguard.hooks.checkpoint.objectstore.url import is_object_store_url
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkAdapter, guard_for, warn_stateless_stream


DATA_FILE = "spotguard-data.json"  # the ElasticSampler's position, beside the Trainer's files in checkpoint-N


def write_position(sampler: ElasticSampler, folder: Path) -> None:
    """Rank 0 only: the sampler's position as `folder/DATA_FILE`."""
    (folder / DATA_FILE).write_text(json.dumps(sampler.state_dict()))


def read_position(sampler: ElasticSampler, trainer: Any, store: Any = None) -> None:
    """At a resume (global step > 0): the position saved with `checkpoint-<global step>`, into
    `sampler` (with an `s3://` output_dir, from the copy `store` downloaded)."""
    step = trainer.state.global_step
    if step == 0:
        return
    tag = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    info = store.read(tag) if store is not None and is_object_store_url(trainer.args.output_dir) else None
    path = (info.dir if info is not None else Path(trainer.args.output_dir) / tag) / DATA_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataPositionError(f"resumed at global step {step}, but {path} holds no data position ({exc}): the "
                                "checkpoint was saved without the sampler, or the Trainer resumed from a checkpoint "
                                "outside its output_dir") from None
    sampler.load_state_dict(state)


def last_checkpoint(trainer: Any) -> str | None:
    """What `trainer.train(resume_from_checkpoint=...)` resumes from: the newest complete
    `checkpoint-N` in the Trainer's `output_dir` (transformers' `get_last_checkpoint`; a save in
    progress, `.pending-checkpoint-N`, is not one), or None when there is none yet (no folder, or
    an empty one), so a first run starts from scratch. With an `s3://` output_dir: the newest
    complete checkpoint in the object store, downloaded and verified (falling back to an older one
    when damaged), as a local folder."""
    if is_object_store_url(trainer.args.output_dir):
        info = open_store(trainer.args.output_dir).resolve(verify=True)
        return str(info.dir) if info is not None else None
    output_dir = Path(trainer.args.output_dir)
    return get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None


class TrainerSave(FrameworkAdapter):
    """The Trainer's own checkpoint through the snapshot engine, committed as `output_dir/checkpoint-N`
    (module docstring)."""

    def __init__(self, trainer: Any, sampler: ElasticSampler | None = None):
        self.trainer = trainer
        self.sampler = sampler
        self.resumed_step: int | None = None
        location = trainer.args.output_dir  # an s3:// URL stays a string: Path would make it a folder name
        self.output_dir = location if is_object_store_url(location) else Path(location)
        super().__init__(self.output_dir)

    def _tag(self, step: int, reason: str) -> str:
        return f"{PREFIX_CHECKPOINT_DIR}-{step}"

    def _capture_root(self, step: int) -> Path:
        return self.scratch / f"{PREFIX_CHECKPOINT_DIR}-{self.trainer.state.global_step}"

    def _framework_save(self, root: Path, step: int) -> None:
        args = self.trainer.args
        kept = args.output_dir, args.push_to_hub
        args.output_dir, args.push_to_hub = str(self.scratch), False
        try:
            self.trainer._save_checkpoint(self.trainer.model_wrapped, trial=None)
        finally:
            args.output_dir, args.push_to_hub = kept
        if self.sampler is not None and self.trainer.state.is_world_process_zero:
            write_position(self.sampler, root)

    def resume(self) -> int | None:
        """The Trainer resumes itself (`resume_from_checkpoint`); this only reads the store's record of
        the checkpoint it picks (the notice it answered, its step: `resumed_step`). Returns None:
        nothing loaded here."""
        last = last_checkpoint(self.trainer)
        info = self.store.read(Path(last).name) if last else None
        self.resumed_metadata = dict(info.metadata) if info is not None else None
        self.resumed_step = info.step if info is not None else None
        return None

    def gradient_carrier(self) -> Any:
        import torch

        model = self.trainer.model_wrapped
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class SpotguardCallback(TrainerCallback):
    """See the module docstring."""

    def __init__(self, trainer: Any, *, sampler: ElasticSampler | None = None, **guard_options: Any):
        versions.require("transformers", "spotguard.integrations.hf")
        self.trainer = trainer
        self.sampler = sampler
        self.guard_options = guard_options
        self.guard: Guard | None = None
        self.adapter: TrainerSave | None = None
        if sampler is not None:
            if not trainer.args.ignore_data_skip:
                raise ConfigError("ignore_data_skip", "must be True with a sampler (TrainingArguments): the sampler "
                                  "holds the data position, and the Trainer's own skip would skip a second time")
            order = sampler.global_order()
            trainer._get_train_sampler = lambda train_dataset=None: order  # the Trainer's train sampler hook

    @classmethod
    def attach(cls, trainer: Any, *, sampler: ElasticSampler | None = None, **guard_options: Any) -> SpotguardCallback:
        """The one line: checks the version and adds the callback to `trainer` (with `sampler`:
        the Trainer's train sampler; module docstring)."""
        callback = cls(trainer, sampler=sampler, **guard_options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        if self.guard is None:
            self.adapter = TrainerSave(self.trainer, self.sampler)
            self.guard = guard_for(self.adapter, **self.guard_options)
            self.guard.resume()  # the notice the resumed checkpoint answered is not acted on again
        if self.sampler is not None:
            self._check_data(args, state)
        else:
            warn_stateless_stream(self.trainer.train_dataset, "the Trainer SpotguardCallback")

    def _check_data(self, args, state) -> None:
        sampler = self.sampler
        assert sampler is not None
        per_step = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        shape = sampler.geometry(args.world_size)
        if per_step != shape.global_size:
            raise ConfigError("per_device_train_batch_size", f"{args.per_device_train_batch_size} x {args.world_size} "
                              f"ranks x {args.gradient_accumulation_steps} accumulation = {per_step} samples per step, "
                              f"but the sampler's step takes {shape.global_size}")
        read_position(sampler, self.trainer, self.adapter.store if self.adapter is not None else None)
        sampler.check_position(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is None:
            return
        if self.sampler is not None:
            self.sampler.advance()  # this step's global batch is consumed: a save at this boundary holds that
        if self.guard.step(state.global_step):
            # Reached only with attach(trainer, exit_on_drain=False): by default the Guard ends the
            # process after the drain (83, 84 if the save failed) inside step(). Here the Trainer stops.
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        """The Trainer saved `checkpoint-<global step>` itself: the data position goes beside it."""
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.sampler is not None and state.is_world_process_zero and folder.is_dir():
            write_position(self.sampler, folder)

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None:
            self.guard.close()
            self.guard = None
