"""spotguard for Accelerate: a helper around `Accelerator`.

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = AccelerateGuard(accelerator, checkpoint_dir="/ckpt", model=model)   # the one line
    start = guard.resume()                        # steps already done (0 without a checkpoint)
    for step, batch in guard.batches(loader, start, total):
        ...forward, accelerator.backward(loss), optimizer.step()...
        guard.step(step)                          # on a notice: every rank saves this step, exit 83

Launch with `spotguard launch` (torchrun's flags), which exits 83 when every rank drained; torchrun
reports any worker's non-zero exit as its own exit 1.

Contract:
- Made on every rank after `prepare` (same order), it checks the accelerate version
  (UnsupportedFramework naming the versions needed) and makes the Guard; with `model=` (the
  prepared DDP model) the agreement rides on DDP's gradient all_reduce.
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
  number of steps done; `batches(loader, start, total)` yields `(step, batch)` from that step on,
  skipping the batches already consumed in the current epoch (`skip_first_batches`), so the data
  position continues (keep the global batch the same at every world size).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError
from spotguard.hooks import Guard
from spotguard.hooks.adapters.store import CheckpointInfo
from spotguard.integrations import versions
from spotguard.integrations.core import FrameworkAdapter, guard_for


class AcceleratorSave(FrameworkAdapter):
    """`save_state` through the snapshot engine and the store, `load_state` to resume (module docstring)."""

    def __init__(self, accelerator: Any, checkpoint_dir: str | os.PathLike, *, model: Any = None,
                 keep_last: int = 3):
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise ConfigError("automatic_checkpoint_naming", "must be off: spotguard names and commits the "
                              "checkpoint directories itself")
        self.accelerator = accelerator
        self.model = model
        super().__init__(checkpoint_dir, keep_last=keep_last)

    def _framework_save(self, root: Path, step: int) -> None:
        self.accelerator.save_state(str(root))

    def _load(self, info: CheckpointInfo) -> None:
        self.accelerator.load_state(str(info.dir))

    def gradient_carrier(self) -> Any:
        import torch

        model = self.model
        return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


class AccelerateGuard:
    """See the module docstring."""

    def __init__(self, accelerator: Any, checkpoint_dir: str | os.PathLike, *, model: Any = None, keep_last: int = 3,
                 **guard_options: Any):
        versions.require("accelerate", "spotguard.integrations.accelerate")
        self.accelerator = accelerator
        self.adapter = AcceleratorSave(accelerator, checkpoint_dir, model=model, keep_last=keep_last)
        self.guard: Guard = guard_for(self.adapter, **guard_options)

    def resume(self) -> int:
        """Loads the newest complete checkpoint (every rank); the number of steps already done."""
        return self.guard.resume()

    def path_of_latest(self) -> Path | None:
        """The newest complete checkpoint's directory (an ordinary `save_state` directory)."""
        info = self.adapter.store.resolve(verify=False)
        return None if info is None else info.dir

    def batches(self, loader: Any, start: int, total: int) -> Iterator[tuple[int, Any]]:
        """(step, batch) for steps `start`..`total - 1`, epoch after epoch, resuming mid-epoch."""
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
        The first call of a run allocates the engine's buffers (every rank: it is collective)."""
        if not self.adapter.prepared:
            self.adapter.prepare()
        return self.guard.step(step)

    def close(self) -> None:
        self.guard.close()
