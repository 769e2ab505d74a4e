"""Plain torch (one process): model + optimizer (+ optional LR scheduler) as `state` shards.

    ckpt = PlainTorchAdapter(model, optimizer, checkpoint_dir="/ckpt", extra_state=lambda: {"data_pos": pos})
    guard = Guard.from_env(adapter=ckpt, snapshot_every=10)
    start = guard.resume()          # ckpt.extra["data_pos"] after a resume

Saves run on the snapshot engine (checkpoint/engine.py): the state dicts are copied into buffers
allocated once, and that copy is written in the background as `state-index.pt` plus `state-K-of-N.pt`
shards written at the same time (checkpoint/torchshards.py: each file is `torch.save`, and
`load_torch_shards(checkpoint_dir / tag, "state")` gives the state dict back). Checkpoints of the
earlier layout, one `state.pt` (`torch.save` of the same dict), still load.
"""
from __future__ import annotations

from typing import Any

import torch

from spotguard.hooks.adapters.base import StoreAdapter
from spotguard.hooks.checkpoint.torchshards import index_file, load_torch_shards, save_torch_shards

STATE = "state"
SINGLE_FILE = "state.pt"  # the layout before the shards: read, never written


class PlainTorchAdapter(StoreAdapter):
    """Checkpoints one process's model and optimizer through the store."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler=None, **kwargs):
        """`kwargs`: `checkpoint_dir` or `store`, `keep_last`, `extra_state`, `data` (see StoreAdapter)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        super().__init__(**kwargs)

    def _state(self, step: int) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _write_state(self, pending, state: dict[str, Any]) -> None:
        save_torch_shards(pending, STATE, state)

    def _load(self, info) -> None:
        if index_file(STATE) in info.files:
            state = load_torch_shards(info.dir, STATE)
        else:
            state = torch.load(info.dir / SINGLE_FILE, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
