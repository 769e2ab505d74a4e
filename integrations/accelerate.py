"""spotguard for Accelerate: a helper around `Accelerator`.

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = AccelerateGuard(accelerator, checkpoint_dir="/ckpt", model=model)   # the one line
    start = guard.resume()                        # steps already done (0 without a checkpoint)
    for step, batch in guard.batches(loader, start, total):
        ...forward, accelerator.backward(loss), optimizer.step()...
        guard.step(step)                          # on a notice: every rank saves this step, exit 83

Contract:
- Made on every rank after `prepare` (same order), it checks the accelerate version
  (UnsupportedFramework naming the versions needed) and makes the Guard; with `model=` (the
  prepared DDP model) the agreement rides on DDP's gradient all_reduce.
- Saves are `accelerator.save_state(dir)` (model, optimizer, scheduler, RNG, and every object
  given to `register_for_checkpointing`) written into the checkpoint store's pending directory
  and committed by the store: a checkpoint is complete or invisible (`hooks/checkpoint/store.py`,
  manifest with checksums, `latest`, retention of `keep_last` plus every notice's checkpoint).
  `path_of_latest()` is an ordinary `save_state` directory: `accelerator.load_state(path)` reads it.
- `resume()` loads the newest complete checkpoint with `accelerator.load_state` and returns the
  number of steps done; `batches(loader, start, total)` yields `(step, batch)` from that step on,
  skipping the batches already consumed in the current epoch (`skip_first_batches`), so the data
  position continues (keep the global batch the same at every world size).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError
from spotguard.hooks import Guard
from spotguard.hooks.adapters.base import StoreAdapter
from spotguard.hooks.adapters.store import CheckpointInfo
from spotguard.integrations import versions
from spotguard.integrations.core import guard_for


class AcceleratorSave(StoreAdapter):
    """`save_state` / `load_state` through the checkpoint store (see the module docstring). It takes
    no in-memory snapshots (the Guard's `snapshot_every` is 0), so the drain saves fresh without a vote."""

    takes_snapshots = False

    def snapshot(self, step: int) -> None:
        raise NotImplementedError("the framework integrations take no in-memory snapshots")

    def __init__(self, accelerator: Any, checkpoint_dir: str | os.PathLike, *, model: Any = None,
                 keep_last: int = 3):
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise ConfigError("automatic_checkpoint_naming", "must be off: spotguard names and commits the "
                              "checkpoint directories itself")
        self.accelerator = accelerator
        self.model = model
        self.save_started_at: float | None = None  # time.time() when the last save began (the reaction bench)
        super().__init__(checkpoint_dir=checkpoint_dir, keep_last=keep_last)

    def save(self, step: int, *, reason: str = "periodic", notice=None):
        self.save_started_at = time.time()
        return super().save(step, reason=reason, notice=notice)

    def _write(self, pending, step: int) -> None:
        failure = None
        try:
            self.accelerator.save_state(str(pending.dir))
        except Exception as exc:
            failure = exc
        if not self._all_ok(failure is None):  # rank 0 records the files only once every rank wrote its own
            raise RuntimeError(f"save_state of step {step} failed on a rank") from failure
        if self.rank == 0:
            for path in sorted(p for p in Path(pending.dir).rglob("*") if p.is_file()):
                name = str(path.relative_to(pending.dir))
                if not name.startswith(".spotguard-part-"):
                    pending.adopt(name)

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
        """After step `step` on every rank: drains here (exit 83) when the ranks agree on a notice."""
        return self.guard.step(step)

    def close(self) -> None:
        self.guard.close()
