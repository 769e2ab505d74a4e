"""torch.distributed.checkpoint (DCP): model + optimizer of DDP or FSDP2 jobs, resharded on resume.

    ckpt = TorchDCPAdapter(model, optimizer, checkpoint_dir="/ckpt", extra_state=lambda: {"data_pos": pos})
    guard = Guard.from_env(adapter=ckpt, snapshot_every=20)
    start = guard.resume()                 # any world size: DCP reshards on load
    for step in range(start, total):
        ...
        if step % 100 == 0: ckpt.save_async(step)   # periodic, off the critical path
        guard.step(step)

Contract:
- State is `get_state_dict(model, optimizer)` (DTensor shards under FSDP2, full tensors under
  DDP), written by DCP straight into the store's pending checkpoint through
  `checkpoint.dcp.StoreDcpWriter` (DCP's own extension point); resume loads through
  `StoreDcpReader` into this job's `get_state_dict` layout, which reshards to the current world
  size, then `set_state_dict`.
- Every save runs on the snapshot engine (checkpoint/engine.py): `get_state_dict`'s state (as
  `dcp_state.StateCapture` gives it: the same dict, with the names learnt once) is copied into
  host buffers allocated once (DTensors keep their spec over a host copy of the local shard;
  pinned, on a side stream, for GPU tensors), then `dcp.save` writes that copy in the background.
  Every DCP collective runs on the formation's checkpoint group (`agreement.control_group`, made
  by spotguard), so a persist in flight never mixes with training's or the Guard's collectives.
  `save_async(step)` copies now and commits in the background (one in flight; the next save or
  snapshot waits for it). A notice's `save()` is the same copy, then
  waits until the commit: durable when it returns. An in-place change's checkpoint coordinates
  through a `StoreChannel` on the old formation's store instead (`writes_over_channel`,
  `checkpoint.dcp_over_channel`: DCP's protocol, the same files), so the survivors leave the old
  group, form the new one and rebuild while it commits.
- `gradient_carrier()` is the model when it is DDP and `piggyback` is on: the Guard then carries
  its agreement inside the model's gradient all_reduce.
- In place (`build=` given: a function that makes a fresh `(model, optimizer)` for the CURRENT
  default process group, the same function every rank and every joiner uses): `full_state()`
  (collective on the current group) is the whole model and optimizer state, gathered from every
  rank's shards under FSDP2, on every rank; after the group was re-formed, `rebuild()` makes the
  model and optimizer anew (collective on the new group, as a joiner's `build()`; the group's
  checkpoint group was made when it formed) and `load_full_state(state)` loads it, sharding it
  to the new mesh. `model` and `optimizer` then name the new objects: training code reads them again after a resize.
  The peer-to-peer transfer (`hooks/elastic/transfer.py`, the default) uses `shard_state()`
  (this rank's pieces and their layouts, local), `shard_device()` and `load_shards(manifest, pieces)`
  (`ResizableAdapter` declares all of them) instead of
  the full state: no rank then holds more than its old and new pieces. A `build` that makes the
  model on the meta device and materialises only the shards (`to_empty` after `fully_shard`)
  keeps the rebuild from allocating the whole model too: its values are overwritten anyway, and
  `rebuild()` skips the random fills `build` makes on them (`elastic/overwritten_init.py`; a
  module tensor it skipped and the build keeps outside the model fails the change).
"""
from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spotguard.hooks.adapters.base import ResizableAdapter, StoreAdapter
from spotguard.hooks.adapters.dcp_state import StateCapture
from spotguard.hooks.checkpoint.dcp import StoreDcpReader, StoreDcpWriter
from spotguard.hooks.checkpoint.dcp_over_channel import save_over_channel
from spotguard.hooks.checkpoint.store_channel import StoreChannel
from spotguard.hooks.checkpoint.types import CheckpointInfo, PendingCheckpoint
from spotguard.hooks.elastic.overwritten_init import skipping_random_init
from spotguard.hooks.elastic.reshard_state import Shards, collect, install
from spotguard.hooks.elastic.transfer import gathering

log = logging.getLogger("spotguard.hooks.adapters.dcp")


def _shard_like(mine: Any, full: Any) -> Any:
    """`full` (nested dicts and lists) with every tensor whose counterpart in `mine` (the live,
    sharded state) is a DTensor cut to that DTensor's shard; everything else as `full` has it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(mine, DTensor) and isinstance(full, torch.Tensor):
        return distribute_tensor(full.detach(), mine.device_mesh, mine.placements, src_data_rank=None)
    if isinstance(full, dict) and isinstance(mine, dict):
        return {k: _shard_like(mine.get(k), v) for k, v in full.items()}
    if isinstance(full, (list, tuple)) and isinstance(mine, (list, tuple)) and len(full) == len(mine):
        return type(full)(_shard_like(m, f) for m, f in zip(mine, full))
    return full


class TorchDCPAdapter(StoreAdapter, ResizableAdapter):
    """Checkpoints a DDP or FSDP2 model and its optimizer with DCP through the store."""

    writes_over_channel = True  # DCP's protocol runs through a StoreChannel too (dcp_over_channel)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, piggyback: bool = True,
                 build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None, **kwargs):
        """`piggyback` (DDP models): the Guard's agreement rides on the gradient all_reduce.
        `build`: makes a fresh (model, optimizer) for the current group; enables in-place resizes.
        `kwargs`: `checkpoint_dir` or `store`, `keep_last`, `extra_state`, `data` (see StoreAdapter)."""
        self.model, self.optimizer = model, optimizer
        self._capture: StateCapture | None = None
        self.piggyback = piggyback
        self.build = build
        super().__init__(**kwargs)

    def gradient_carrier(self) -> Any:
        if self.piggyback and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return self.model
        return None

    def state(self) -> dict[str, Any]:
        """The live state in DCP's layout: {"model": ..., "optim": ...} as `get_state_dict` gives it
        (through `dcp_state.StateCapture`, which learns the names once per model and optimizer)."""
        capture = self._capture
        if capture is None or not capture.serves(self.model, self.optimizer):
            capture = self._capture = StateCapture(self.model, self.optimizer)
        return capture.capture()

    # ---- in place ----------------------------------------------------------------------------
    @property
    def resizable(self) -> bool:
        return self.build is not None

    def full_state(self) -> dict[str, Any]:
        """The whole state on every rank (collective: FSDP2 shards are gathered)."""
        self.wait()
        model_state, optim_state = get_state_dict(self.model, self.optimizer,
                                                  options=StateDictOptions(full_state_dict=True))
        return {"model": model_state, "optim": optim_state}

    def shard_state(self) -> Shards:
        """This rank's pieces of the model and optimizer state with their layouts (local: views,
        no copy, no communication); what an in-place change moves peer to peer. No wait for a
        persist in flight: it reads the engine's buffers, not these tensors, so the change hands
        the shards over while the agreed step's write runs."""
        return collect(self.model, self.optimizer, self.world_size)

    def shard_device(self) -> torch.device:
        """Where this rank's pieces live (a joiner allocates its new pieces there)."""
        return next(iter(self.model.parameters()), torch.empty(0)).device

    def load_shards(self, manifest: dict[str, Any], pieces: dict[int, torch.Tensor]) -> None:
        """This rank's new pieces (entry index -> piece, in the manifest's layout at the current
        world size) become the rebuilt model's parameters and the optimizer's state."""
        install(self.model, self.optimizer, manifest, pieces)

    def rebuild(self) -> None:
        """A fresh model and optimizer on the current default group (collective); the adapter's
        collectives move to the new formation's checkpoint group."""
        if self.build is None:
            raise RuntimeError("this adapter was made without build=: it cannot be resized in place")
        # A write in flight reads its own snapshot, bound to its channel. The shard transfer
        # overwrites every parameter and buffer: the build's random fills are skipped.
        self.model, self.optimizer = self.build() if gathering(self) else skipping_random_init(self.build)
        self._snapshot, self.snapshot_step = None, None
        self.prepared = False  # another shard: the buffers are re-sized at the next step boundary
        self._setup_group()

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Loads a `full_state()` into the current model and optimizer, sharded as they are: each
        rank cuts its own shards from the full tensors (no communication, and no mesh lookup by
        group name, which a re-formed default group reuses)."""
        loaded = _shard_like(self.state(), {"model": state["model"], "optim": state["optim"]})
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])

    # ---- StoreAdapter hooks ---------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        return self.state()

    def _write_state(self, pending: PendingCheckpoint, state: dict[str, Any]) -> None:
        dcp.save(state, storage_writer=StoreDcpWriter(pending), process_group=self._group)

    def _write_state_over(self, pending: PendingCheckpoint, state: dict[str, Any], channel: StoreChannel) -> None:
        save_over_channel(state, StoreDcpWriter(pending), channel)

    def _load(self, info: CheckpointInfo) -> None:
        state = self.state()
        dcp.load(state, storage_reader=StoreDcpReader(info.dir), process_group=self._group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
