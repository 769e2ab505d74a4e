"""The reference trainer's model and data: small, deterministic, world-size independent.

The data for global step `s` is a function of (seed, s) only, so a job resumed at step s at any
world size sees exactly the samples an uninterrupted job would have seen: each rank takes its
contiguous share of the step's global batch.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

IN_FEATURES = 32
HIDDEN = 64
OUT_FEATURES = 8


class TinyMLP(nn.Module):
    """A two-layer MLP (about 3k parameters): big enough to learn, small enough for CPU tests."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT_FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(seed: int) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def _teacher(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(IN_FEATURES, OUT_FEATURES, generator=g) / IN_FEATURES ** 0.5


def global_batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of step `step` (inputs, targets); identical on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.tanh(x @ _teacher(seed)) + 0.01 * torch.randn(size, OUT_FEATURES, generator=g)
    return x, y


def rank_share(x: torch.Tensor, rank: int, world_size: int) -> slice:
    """The contiguous slice of a global batch that `rank` trains on."""
    per_rank = x.shape[0] // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def state_digest(*tensor_dicts: dict) -> str:
    """sha256 over the tensors of the given (nested) state dicts, in sorted key order."""
    h = hashlib.sha256()

    def feed(obj, prefix: str) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(prefix.encode())
            h.update(
                obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                feed(obj[key], f"{prefix}.{key}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                feed(item, f"{prefix}[{i}]")
        elif isinstance(obj, (int, float, str, bool)) or obj is None:
            h.update(f"{prefix}={obj!r}".encode())

    for i, d in enumerate(tensor_dicts):
        feed(d, str(i))
    return h.hexdigest()[:16]
