"""DeepSpeed: `save_checkpoint` on every rank with the same tag, resume at any data-parallel size.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    ckpt = DeepSpeedAdapter(engine, checkpoint_dir="/ckpt", extra_state=lambda: {"data_pos": pos})
    guard = Guard.from_env(adapter=ckpt)
    start = guard.resume()        # converts to a universal checkpoint when the DP size changed

Contract:
- The adapter installs `StoreCheckpointEngine` as the engine's checkpoint engine (DeepSpeed's own
  extension point). At a save `save_checkpoint(scratch, tag="ds", client_state={"step", "extra"},
  save_latest=False)` runs on every rank with the engine capturing, by reference, the state dict
  of every file DeepSpeed would write (it asks DeepSpeed for no clones); the snapshot engine
  (checkpoint/engine.py) copies them into buffers allocated once, and persists each file as
  `torch.save` of that copy into the store's pending directory (fsynced, checksummed), in the
  background; the store's commit then makes the checkpoint visible atomically. The files are
  DeepSpeed's own format, so `load_checkpoint`, `ds_to_universal` and `zero_to_fp32` read them.
- Resume: the newest verified checkpoint. Same DP world size (or ZeRO-0): `load_checkpoint`.
  Different DP world size under ZeRO-1/2: rank 0 converts it once with
  `python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` into
  `<checkpoint_dir>/_universal/<tag>/ds`, a derived copy of the store (checkpoint/derived.py):
  built in a hidden dir and renamed into place, reused only if made from this very commit of
  the tag, removed by retention once its checkpoint is no longer among the newest `keep_last`.
  Every rank loads it with the engine's universal loading switched on for that load only.
- A snapshot is the same capture and copy without the persist.
- In place (`in_place=True`, ZeRO-1/2 jobs `deepspeed_support.refusal` accepts; any other job
  logs why once, at start, and keeps the restart path): the adapter is a `ResizableAdapter`. An
  in-place change moves each rank's fp32 master and Adam partitions peer to peer
  (`deepspeed_zero.collect` / `install`, never through files; each rank receives only its new
  partition), and `rebuild()` makes the engine again on the new group in the same process, the
  module kept (`deepspeed_zero.reinitialize`, the old engine's memory released). The step
  counts, the LR scheduler, the loss scaler and the engine's counters come along; the data
  position too (`data=`). Training code reads `adapter.engine` again after a change
  (`guard.step(...).resize`): the engine it held before is destroyed. The new engine's config is
  `config_for(world_size)` when given, else the old one with the same micro-batch and
  gradient-accumulation steps per rank (DeepSpeed's `train_batch_size` follows the world size).
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from spotguard.hooks.adapters.base import ResizableAdapter, StoreAdapter
from spotguard.hooks.adapters.deepspeed_support import refusal
from spotguard.hooks.checkpoint.torchfile import save_torch_file

if TYPE_CHECKING:
    from spotguard.hooks.elastic.reshard_state import Shards

log = logging.getLogger("spotguard.hooks.adapters.deepspeed")

DS_TAG = "ds"
UNIVERSAL_KIND = "universal"  # copies live in <checkpoint_dir>/_universal/<tag>/


class StoreCheckpointEngine(CheckpointEngine):
    """DeepSpeed checkpoint engine that captures what `save_checkpoint` would write.

    `capture(base)`: each `save(state_dict, path)` under `base` is kept, by reference, as
    `captured[relpath] = state_dict` (no bytes written); `preserves_storage_sharing()` is False,
    so DeepSpeed hands over its live tensors instead of cloning them: the snapshot engine's
    copy is the only one.
    """

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.name = "SpotguardStoreCheckpointEngine"
        self._base: Path | None = None
        self.captured: dict[str, Any] | None = None

    def capture(self, base: str | os.PathLike) -> None:
        self._base, self.captured = Path(base), {}

    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        if self._base is None or self.captured is None:
            raise RuntimeError("StoreCheckpointEngine.save outside a spotguard checkpoint")
        relpath = Path(path).absolute().relative_to(self._base.absolute()).as_posix()
        self.captured[relpath] = state_dict

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False


def config_at(engine, world_size: int) -> dict[str, Any]:
    """`engine`'s config for `world_size` ranks: the same micro-batch and gradient-accumulation
    steps per rank, `train_batch_size` their product times the world size."""
    config = copy.deepcopy(engine._config._param_dict)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                  train_batch_size=micro * accumulation * world_size)
    return config


class DeepSpeedAdapter(StoreAdapter, ResizableAdapter):
    """Checkpoints a DeepSpeed engine through the store; see the module docstring."""

    def __init__(self, engine, *, in_place: bool = False,
                 config_for: Callable[[int], dict[str, Any]] | None = None, **kwargs):
        """`in_place`: changes of the data-parallel size move the state peer to peer and rebuild the
        engine in this process (ZeRO-1/2; module docstring). `config_for(world_size)`: the DeepSpeed
        config of the engine rebuilt for that many ranks (default `config_at`). `kwargs`:
        `checkpoint_dir` or `store`, `keep_last`, `extra_state`, `data` (see StoreAdapter)."""
        self.engine = engine
        self.ds_engine = StoreCheckpointEngine()
        engine.checkpoint_engine = self.ds_engine
        self._scratch = Path(tempfile.mkdtemp(prefix="spotguard-ds-snapshot-"))
        self.config_for = config_for
        self.in_place_refusal: str | None = None
        if in_place:
            from spotguard.hooks.adapters.deepspeed_zero import facts_of

            facts = facts_of(engine)
            self.in_place_refusal = refusal(facts)
            if self.in_place_refusal:
                log.warning("this DeepSpeed job changes membership by restarting: %s", self.in_place_refusal)
            elif "cpuadam" in facts.optimizer.lower():  # a rebuilt CPU Adam asks for the CPU again: kept
                from spotguard.hooks.elastic.join import keep_cpu_info

                keep_cpu_info(prime=True)
        self.in_place = in_place and self.in_place_refusal is None
        super().__init__(**kwargs)

    # ---- in place ----------------------------------------------------------------------------
    @property
    def resizable(self) -> bool:
        return self.in_place

    def shard_state(self) -> Shards:
        """This rank's fp32 master and optimizer partitions as reshard pieces (views, no copy);
        like DCP's, no wait for a persist in flight: it reads the snapshot buffers."""
        from spotguard.hooks.adapters.deepspeed_zero import collect

        return collect(self.engine)

    def shard_device(self) -> torch.device:
        partitions = self.engine.optimizer.single_partition_of_fp32_groups
        return partitions[0].device if partitions else torch.device("cpu")

    def load_shards(self, manifest: dict[str, Any], pieces: dict[int, torch.Tensor]) -> None:
        """Collective over the new group (the model's parameters are all-gathered from the fp32
        master, as DeepSpeed's step does)."""
        from spotguard.hooks.adapters.deepspeed_zero import install

        install(self.engine, manifest, pieces)

    def full_state(self) -> dict[str, Any]:
        raise RuntimeError("a DeepSpeed engine moves its partitions peer to peer only: unset SPOTGUARD_RESHARD")

    def load_full_state(self, state: dict[str, Any]) -> None:
        raise RuntimeError("a DeepSpeed engine moves its partitions peer to peer only: unset SPOTGUARD_RESHARD")

    def rebuild(self) -> None:
        """The engine made again on the current default group, the module kept (collective); the
        adapter's collectives move to the new formation's checkpoint group."""
        import torch.distributed as dist

        from spotguard.hooks.adapters.deepspeed_zero import reinitialize

        if not self.in_place:
            raise RuntimeError(f"this adapter cannot be resized in place: "
                               f"{self.in_place_refusal or 'it was made without in_place=True'}")
        self.wait()
        world = dist.get_world_size()
        config = self.config_for(world) if self.config_for is not None else config_at(self.engine, world)
        self.engine = reinitialize(self.engine, config)
        self.engine.checkpoint_engine = self.ds_engine
        self._snapshot, self.snapshot_step = None, None
        self.prepared = False  # another partition: the buffers are re-sized at the next step boundary
        self._setup_group()

    # ---- sizes ----------------------------------------------------------------------------
    def dp_world_size(self) -> int:
        return int(getattr(self.engine, "seq_dp_world_size", None) or self.engine.dp_world_size)

    def _metadata_extra(self) -> dict[str, Any]:
        return {"dp_world_size": self.dp_world_size(), "zero_stage": int(self.engine.zero_optimization_stage())}

    def _client_state(self, step: int) -> dict[str, Any]:
        return {"spotguard_step": step, "spotguard_extra": self.extra_state() if self.extra_state else {}}

    # ---- StoreAdapter hooks ---------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        """{relpath: state dict} of every file `save_checkpoint` writes at `step` (live tensors)."""
        self.ds_engine.capture(self._scratch)
        try:
            self.engine.save_checkpoint(
                str(self._scratch), tag=DS_TAG, client_state=self._client_state(step), save_latest=False)
            return dict(self.ds_engine.captured or {})
        finally:
            self.ds_engine.captured = None

    def _write_state(self, pending, files: dict[str, Any]) -> None:
        for relpath, state_dict in files.items():
            save_torch_file(pending, relpath, state_dict)

    def _load(self, info) -> None:
        saved_dp = int(info.metadata.get("dp_world_size") or info.world_size)
        stage = int(self.engine.zero_optimization_stage())
        if saved_dp != self.dp_world_size() and stage in (1, 2):
            load_dir = self._universal(info)
            log.warning("checkpoint %s was saved at DP world size %d, resuming at %d: loading its universal form",
                        info.tag, saved_dp, self.dp_world_size())
            config = self.engine._config
            previous = config.load_universal_checkpoint
            config.load_universal_checkpoint = True
            try:
                path, _client = self.engine.load_checkpoint(str(load_dir), tag=DS_TAG)
            finally:
                config.load_universal_checkpoint = previous
        else:
            path, _client = self.engine.load_checkpoint(str(Path(info.dir)), tag=DS_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {info.tag}")

    def _universal(self, info) -> Path:
        """The universal copy of exactly this commit of `info` (`<root>/_universal/<tag>`), converted
        by rank 0 unless a copy made from this very commit exists; every rank returns after it does."""
        copies = self.store.derived(UNIVERSAL_KIND)
        ok = True
        if self.rank == 0 and copies.lookup(info) is None:
            try:
                copies.build(info, lambda out: self._convert(info, out))
            except Exception:  # every rank must learn about the failure
                log.exception("conversion of %s to a universal checkpoint failed", info.tag)
                ok = False
        if not self._collectives.all_ok(ok):
            raise RuntimeError(f"conversion of {info.tag} to a universal checkpoint failed")
        return copies.path(info.tag)

    @staticmethod
    def _convert(info, out: Path) -> None:
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                   "--input_folder", str(Path(info.dir) / DS_TAG), "--output_folder", str(out / DS_TAG),
                   "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed ({result.returncode}): {result.stderr[-2000:]}")

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._scratch, ignore_errors=True)
