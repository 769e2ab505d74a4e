"""spotguard for Accelerate: a helper around `Accelerator`.

    sampler = ElasticSampler(dataset, global_batch=32, seed=0)           # optional: the data position
    loader = DataLoader(dataset, batch_size=32 // world_size, sampler=sampler.global_order())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = AccelerateGuard(accelerator, checkpoint_dir="/ckpt", model=model, sampler=sampler)  # the one line
    start = guard.resume()                        # steps already done (0 without a checkpoint)
    for step, batch in guard.batches(loader, start, total):
        ...forward, accelerator.backward(loss), optimizer.step()...
        guard.step(step)                          # on a notice: every rank saves this step, exit 83

Launch with `spotguard launch` (torchrun's flags), which exits 83 when every rank drained; torchrun
reports any worker's non-zero exit as its own exit 1.

In place (opt-in, `in_place=True`, for a job launched in place: survivors keep their processes
through a membership change, a joiner receives the state from a live peer):

    init_process_group()                          # spotguard.hooks.elastic, before the Accelerator
    accelerator = Accelerator()
    sampler = ElasticSampler(dataset, global_batch=32, micro_batch=8, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)                  # NOT prepared
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    guard = AccelerateGuard(accelerator, "/ckpt", model=model, sampler=sampler, in_place=True)
    start = guard.resume()                        # a joiner receives the state of a live peer here
    for step, micro_batches in guard.steps(loader, start, total):
        for batch in micro_batches:               # the accumulation follows the world size
            accelerator.backward(guard.model(**batch).loss / len(micro_batches))
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
        guard.step(step)

Contract:
- Made on every rank after `prepare` (same order), it checks the accelerate version
  (UnsupportedFramework naming the versions needed) and makes the Guard; with `model=` (the
  prepared DDP model) the agreement rides on DDP's gradient all_reduce; the other keywords go to
  the Guard (`snapshot_every=N`: an in-memory snapshot every N steps, for a notice during your
  evaluation loop: core.py).
- Saves run through the one engine (core.py), as every adapter's do: at the step boundary
  `accelerator.save_state(dir)` (model, optimizer, scheduler, RNG, and every object given to
  `register_for_checkpointing`) runs with its `torch.save` / safetensors writes captured and the
  engine copies the captured tensors into its buffers (allocated at the first `step()` of a run,
  before any notice); the engine then writes those files, in Accelerate's format, into the
  checkpoint store's pending directory in the background, and the store commits them: a
  checkpoint is complete or invisible (`hooks/checkpoint/store.py`, manifest with checksums,
  `latest`, retention of `keep_last` plus every notice's checkpoint). `path_of_latest()` is an
  ordinary `save_state` directory: `accelerator.load_state(path)` reads it.
- `resume()` loads the newest complete checkpoint with `accelerator.load_state` and returns the
  number of steps done; `batches(loader, start, total)` yields `(step, batch)` from that step on.
- The data position. With `sampler=` (a `spotguard.data.ElasticSampler`, registered for
  checkpointing here, so every `save_state` holds its position and `load_state` restores it) the
  loader draws from `sampler.global_order()` and Accelerate deals each step's global batch to the
  ranks; each batch `batches` yields advances the sampler by one global batch (the loader's
  `total_batch_size`, which must be the sampler's samples per step at this world size). Every
  sample is then seen once per epoch at any world size, and with a constant global batch the
  sequence of global batches is an uninterrupted run's. `batches` refuses a loader that does not
  draw from it and a start the sampler's position does not belong to. Without `sampler=`, a
  resume skips `step mod len(loader)` batches of the loader at the new size
  (`skip_first_batches`): exact only when the global batch and the loader's order are the same at
  every world size, and it warns so at a resume.
- In place (`in_place=True`; refused at construction, naming what to change, without spotguard's
  `init_process_group`, under DeepSpeed/FSDP/Megatron/XLA, with other than one optimizer, or
  without `sampler=`; `batches()` is refused then: its prepared loader cannot be re-shared). At
  a membership change the agreed step is checkpointed first (as on the restart path), then the
  Guard's in-place machine runs (hooks/machine/table.py) with `AcceleratorSave` as its resizable
  adapter: the model's parameters and the optimizer's state move peer to peer, the survivors'
  module goes into a new DDP on the new group (`guard.model`), the Accelerator's world is the
  new group's, the optimizer, scheduler and sampler objects are kept; a joiner receives the
  parameters, optimizer state, schedulers', registered objects' (the sampler's position) and
  grad scaler's states in `resume()` (accelerate_in_place.py). `steps()` re-shares the rest of
  the epoch among the new ranks at the next step. Any failure falls back to the checkpoint (exit
  83), as the Guard's path does.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError
from spotguard.data import ElasticSampler, GlobalOrder
from spotguard.hooks import Guard
from spotguard.hooks.adapters.store import CheckpointInfo
from spotguard.hooks.elastic.reshard_state import Shards, collect, install
from spotguard.integrations import accelerate_in_place as in_place_objects
from spotguard.integrations import versions
from spotguard.integrations.core import (FrameworkAdapter, find_in_loader, guard_for, in_place_guard_for,
                                        warn_stateless_stream)

log = logging.getLogger("spotguard.integrations")



class AcceleratorSave(FrameworkAdapter):
    """`save_state` through the snapshot engine and the store, `load_state` to resume (module
    docstring); with `in_place`, the `ResizableAdapter` an in-place change drives (accelerate_in_place.py)."""

    def __init__(self, accelerator: Any, checkpoint_dir: str | os.PathLike, *, model: Any = None,
                 keep_last: int = 3, in_place: bool = False):
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise ConfigError("automatic_checkpoint_naming", "must be off: spotguard names and commits the "
                              "checkpoint directories itself")
        self.accelerator = accelerator
        self.model = model
        self.in_place = in_place
        # In place, what the shard transfer does not carry goes to a joiner as the adapter's data position.
        super().__init__(checkpoint_dir, keep_last=keep_last,
                         data=in_place_objects.Carried(accelerator) if in_place else None)

    def _framework_save(self, root: Path, step: int) -> None:
        self.accelerator.save_state(str(root))

    def _load(self, info: CheckpointInfo) -> None:
        self.accelerator.load_state(str(info.dir))

    def gradient_carrier(self) -> Any:
        import torch

        model = self.model
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None

    # ---- in place (ResizableAdapter) --------------------------------------------------------
    @property
    def resizable(self) -> bool:
        return self.in_place

    def _parts(self) -> tuple[Any, Any]:
        return in_place_objects.module_of(self.model), in_place_objects.optimizer(self.accelerator)

    def full_state(self) -> dict[str, Any]:
        module, optimizer = self._parts()
        return {"model": module.state_dict(), "optim": optimizer.state_dict()}

    def load_full_state(self, state: dict[str, Any]) -> None:
        module, optimizer = self._parts()
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def shard_state(self) -> Shards:
        module, optimizer = self._parts()
        return collect(module, optimizer, self.world_size)

    def shard_device(self) -> Any:
        return next(self._parts()[0].parameters()).device

    def load_shards(self, manifest: dict[str, Any], pieces: dict[int, Any]) -> None:
        install(*self._parts(), manifest, pieces)

    def rebuild(self) -> None:
        """The same module in a new DDP on the new group (collective), the Accelerator's world the
        group's; the optimizer, scheduler and sampler objects are kept."""
        self.wait()
        self.model = in_place_objects.rewrap(self.accelerator, self.model)
        self.moved_to_new_group()


class AccelerateGuard:
    """See the module docstring."""

    def __init__(self, accelerator: Any, checkpoint_dir: str | os.PathLike, *, model: Any = None, keep_last: int = 3,
                 sampler: ElasticSampler | None = None, in_place: bool = False, **guard_options: Any):
        versions.require("accelerate", "spotguard.integrations.accelerate")
        self.accelerator = accelerator
        self.sampler = sampler
        if sampler is not None:
            accelerator.register_for_checkpointing(sampler)  # before any load_state: its position resumes too
        if in_place:
            _check_in_place(accelerator, sampler)
        self.adapter = AcceleratorSave(accelerator, checkpoint_dir, model=model, keep_last=keep_last,
                                       in_place=in_place)
        self.guard: Guard = (in_place_guard_for if in_place else guard_for)(self.adapter, **guard_options)

    @property
    def model(self) -> Any:
        """The prepared model to train with: after an in-place change, the same module in a new
        DDP on the new group (read it again after `step()` returned a resized result)."""
        return self.adapter.model

    def resume(self) -> int:
        """Loads the newest complete checkpoint (every rank); the number of steps already done."""
        return self.guard.resume()

    def path_of_latest(self) -> Path | None:
        """The newest complete checkpoint's directory (an ordinary `save_state` directory)."""
        info = self.adapter.store.resolve(verify=False)
        return None if info is None else info.dir

    def batches(self, loader: Any, start: int, total: int) -> Iterator[tuple[int, Any]]:
        """(step, batch) for steps `start`..`total - 1`, epoch after epoch, resuming mid-epoch
        (module docstring: the data position)."""
        if self.adapter.in_place:
            raise ConfigError("loader", "batches() deals each step through a loader prepared for one world size; "
                              "in place, train with guard.steps(DataLoader(dataset, batch_sampler=sampler), ...), "
                              "the loader not prepared")
        if self.sampler is not None:
            return self._sampled(self.sampler, loader, start, total)
        try:
            len(loader)
        except TypeError:
            raise ConfigError("loader", "has no length (an IterableDataset without __len__?): batches() resumes by "
                              "skipping what the epoch consumed, which needs the epoch's length; give the dataset a "
                              "__len__, or index it and deal it with AccelerateGuard(sampler=ElasticSampler(...))") \
                from None
        warn_stateless_stream(loader, "AccelerateGuard")
        if start > 0:
            log.warning("resuming at step %d by skipping batches of this loader at this world size: exact only when "
                        "the global batch and the loader's order are the same at every world size; give "
                        "AccelerateGuard(sampler=ElasticSampler(...)) and DataLoader(sampler=sampler.global_order()) "
                        "for every sample once per epoch at any world size", start)
        return self._skipping(loader, start, total)

    def steps(self, loader: Any, start: int, total: int) -> Iterator[tuple[int, list[Any]]]:
        """(step, micro_batches) for steps `start`..`total - 1` from `loader`, made
        `DataLoader(dataset, batch_sampler=sampler)` and NOT prepared (the sampler deals each rank its
        share of every step, at whatever world size the group has; module docstring: in place);
        each batch is on the Accelerator's device. A step is `sampler.micro_batches_per_step()`
        micro-batches at the current world size: the gradient accumulation follows the world."""
        from accelerate.utils import send_to_device

        if self.sampler is None:
            raise ConfigError("sampler", "steps() needs AccelerateGuard(sampler=ElasticSampler(...))")
        if hasattr(loader, "base_dataloader") or type(loader).__module__.startswith("accelerate"):
            raise ConfigError("loader", "was prepared by Accelerate, which deals its batches for one world size: give "
                              "steps() the DataLoader(dataset, batch_sampler=sampler) itself, not prepared")
        device = self.accelerator.device
        steps = self.sampler.steps(loader, start, total)  # checks the loader and the start now
        return ((step, [send_to_device(batch, device) for batch in micro]) for step, micro in steps)

    def _sampled(self, sampler: ElasticSampler, loader: Any, start: int, total: int) -> Iterator[tuple[int, Any]]:
        found = find_in_loader(loader, GlobalOrder)
        if found is None or found.sampler is not sampler:
            raise ConfigError("loader", "does not draw from the sampler given to AccelerateGuard: make it "
                              "DataLoader(dataset, batch_size=..., sampler=sampler.global_order()) before prepare")
        shape = sampler.geometry()
        per_batch = getattr(loader, "total_batch_size", shape.global_size)
        if per_batch != shape.global_size:
            raise ConfigError("loader", f"deals {per_batch} samples per step to the ranks together, but the sampler's "
                              f"step takes {shape.global_size} at this world size: make the loader's batch_size "
                              f"{shape.global_size} / {shape.world_size} ranks")
        sampler.check_position(start)
        return self._sampled_steps(sampler, loader, start, total)

    @staticmethod
    def _sampled_steps(sampler: ElasticSampler, loader: Any, start: int, total: int) -> Iterator[tuple[int, Any]]:
        step = start
        while step < total:
            for batch in loader:  # each pass starts at the sampler's position
                sampler.advance()
                yield step, batch
                step += 1
                if step >= total:
                    return

    def _skipping(self, loader: Any, start: int, total: int) -> Iterator[tuple[int, Any]]:
        per_epoch = len(loader)
        if per_epoch == 0:
            raise ConfigError("loader", "is empty")
        step = start
        while step < total:
            epoch, skip = divmod(step, per_epoch)
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            source = self.accelerator.skip_first_batches(loader, skip) if skip else loader
            for batch in source:
                yield step, batch
                step += 1
                if step >= total:
                    return

    def step(self, step: int) -> bool:
        """After step `step` on every rank: drains here (exit 83) when the ranks agree on a notice.
        The Guard's first boundary allocates the engine's buffers (every rank: it is collective)."""
        return self.guard.step(step)

    def close(self) -> None:
        self.guard.close()


def _check_in_place(accelerator: Any, sampler: ElasticSampler | None) -> None:
    """ConfigError naming what to change unless this job can change membership in place."""
    in_place_objects.check(accelerator)
    if sampler is None:
        raise ConfigError("sampler", "in place needs AccelerateGuard(sampler=ElasticSampler(...)): the data is "
                          "re-shared among the new ranks at a change, and only the sampler can do that")
