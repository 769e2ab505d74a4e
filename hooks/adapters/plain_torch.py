"""Plain torch (one process): model + optimizer (+ optional LR scheduler) in one `state.pt`.

    ckpt = PlainTorchAdapter(model, optimizer, checkpoint_dir="/ckpt", extra_state=lambda: {"data_pos": pos})
    guard = Guard.from_env(adapter=ckpt, snapshot_every=10)
    start = guard.resume()          # ckpt.extra["data_pos"] after a resume

A snapshot is the serialized checkpoint held in memory (torch.save into a buffer), so
persisting it is one write.
"""
from __future__ import annotations

import io

import torch

from spotguard.hooks.adapters.base import StoreAdapter

FILE = "state.pt"


class PlainTorchAdapter(StoreAdapter):
    """Checkpoints one process's model and optimizer through the store."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler=None, **kwargs):
        """`kwargs`: `checkpoint_dir` or `store`, `keep_last`, `extra_state` (see StoreAdapter)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        super().__init__(**kwargs)

    def _serialize(self, step: int) -> memoryview:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getbuffer()

    def _write(self, pending, step: int) -> None:
        pending.write_bytes(FILE, self._serialize(step))

    def _take_snapshot(self, step: int) -> bytes:
        return bytes(self._serialize(step))

    def _write_snapshot(self, pending, snapshot: bytes) -> None:
        pending.write_bytes(FILE, snapshot)

    def _load(self, info) -> None:
        state = torch.load(info.dir / FILE, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
