"""Plain torch (one process): model + optimizer (+ optional LR scheduler) in one `state.pt`.

    ckpt = PlainTorchAdapter(model, optimizer, checkpoint_dir="/ckpt", extra_state=lambda: {"data_pos": pos})
    guard = Guard.from_env(adapter=ckpt, snapshot_every=10)
    start = guard.resume()          # ckpt.extra["data_pos"] after a resume

Saves run on the snapshot engine (checkpoint/engine.py): the state dicts are copied into buffers
allocated once, and `state.pt` is `torch.save` of that copy written in the background
(checkpoint/torchfile.py), the same file format as always: `torch.load` reads it.
"""
from __future__ import annotations

from typing import Any

import torch

from spotguard.hooks.adapters.base import StoreAdapter
from spotguard.hooks.checkpoint.torchfile import save_torch_file

FILE = "state.pt"


class PlainTorchAdapter(StoreAdapter):
    """Checkpoints one process's model and optimizer through the store."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler=None, **kwargs):
        """`kwargs`: `checkpoint_dir` or `store`, `keep_last`, `extra_state` (see StoreAdapter)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        super().__init__(**kwargs)

    def _state(self, step: int) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _write_state(self, pending, state: dict[str, Any]) -> None:
        save_torch_file(pending, FILE, state)

    def _load(self, info) -> None:
        state = torch.load(info.dir / FILE, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
