"""The per-epoch order of a dataset's samples, seeded as torch's `DistributedSampler` seeds it.

Contract: `EpochOrder(samples, seed, shuffle).indices(epoch)` is `torch.randperm(samples)` drawn
from a generator seeded with `seed + epoch` (what `DistributedSampler(shuffle=True, seed=seed)`
deals out in `epoch` after `set_epoch(epoch)`), or `0..samples-1` without shuffle; the same on
every rank and every run. `at(position)` is the sample at a position of the stream (the epochs'
orders end to end). The two most recent epochs are kept (a pass reads at most two).
"""
from __future__ import annotations

import torch


class EpochOrder:
    """See the module docstring."""

    def __init__(self, samples: int, seed: int, shuffle: bool):
        self.samples, self.seed, self.shuffle = samples, seed, shuffle
        self._cached: dict[int, list[int]] = {}

    def indices(self, epoch: int) -> list[int]:
        cached = self._cached.get(epoch)
        if cached is None:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + epoch)
                cached = torch.randperm(self.samples, generator=generator).tolist()
            else:
                cached = list(range(self.samples))
            if len(self._cached) >= 2:
                self._cached.pop(min(self._cached))
            self._cached[epoch] = cached
        return cached

    def at(self, position: int) -> int:
        epoch, offset = divmod(position, self.samples)
        return self.indices(epoch)[offset]
