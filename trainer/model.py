"""The reference trainer's model and data: small, deterministic, world-size independent.

The data is a fixed set of samples (`Samples`), each a function of (seed, its index); the
trainer deals them out with `spotguard.data.ElasticSampler`, whose position is in the checkpoint,
so a job resumed or resized at any world size continues the same sample order.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.utils.data import Dataset

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


class Samples(Dataset):
    """`count` fixed samples (inputs, targets, id), a function of (seed, count) alone: sample `i`
    is the same in every process, so a sampler's order and position mean the same everywhere."""

    def __init__(self, seed: int, count: int):
        g = torch.Generator().manual_seed(seed * 1_000_003)
        self.x = torch.randn(count, IN_FEATURES, generator=g)
        self.y = torch.tanh(self.x @ _teacher(seed)) + 0.01 * torch.randn(count, OUT_FEATURES, generator=g)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


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
