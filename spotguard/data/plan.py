"""The elastic sampler's arithmetic, pure (no torch, no I/O): what one optimizer step takes from
the sample stream at a world size, and which of those samples each rank gets.

The stream is the epochs' permutations laid end to end: stream position `p` is sample
`order(p // samples)[p % samples]`. Training consumes it front to back, one global batch per
optimizer step; the cursor (samples consumed, across epochs) is the only position there is, so
it means the same at any world size. A global batch may straddle two epochs: every sample is
still seen exactly once per epoch, no batch is ever short, and nothing is padded.

Contract:
- `geometry(world_size, global_batch=G)` keeps G samples per step at any world size (the
  reference trainer's `--batch-policy keep-global`); `geometry(world_size, batch_size=b)` keeps b
  per rank (`b * world_size` per step). `micro_batch=m` splits each rank's share of a step into
  micro-batches of at most m samples (gradient accumulation). ConfigError, naming what to
  change, when a step has fewer samples than there are ranks, or when ranks would run different
  numbers of micro-batches in one step (their collectives would not match).
- `share(start, geometry, rank)`: the stream positions `rank` trains on in the step whose global
  batch starts at `start`: every world_size-th from `start + rank`, as torch's
  `DistributedSampler` deals an epoch out, so the set of samples of a step is the same at any
  world size, and at one world size equal to DistributedSampler's when the epoch length is a
  multiple of the global batch.
- `micro_batches(positions, geometry)`: those positions cut into the step's micro-batches;
  every rank gets `geometry.micro_per_step` of them.
- `steps_per_pass(samples, geometry)`: how many steps one pass of a loader holds (an epoch's
  worth, rounded up); a pass starts wherever the cursor is.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spotguard.config import ConfigError


@dataclass(frozen=True)
class Geometry:
    """How one optimizer step takes its samples at one world size."""

    world_size: int
    global_size: int  # samples per step, all ranks together
    micro_batch: int | None  # None: a rank's whole share is one batch

    @property
    def micro_per_step(self) -> int:
        """Micro-batches every rank runs per step (the gradient accumulation)."""
        largest = math.ceil(self.global_size / self.world_size)
        return 1 if self.micro_batch is None else math.ceil(largest / self.micro_batch)


def geometry(world_size: int, *, global_batch: int | None = None, batch_size: int | None = None,
             micro_batch: int | None = None) -> Geometry:
    """See the module docstring."""
    if (global_batch is None) == (batch_size is None):
        raise ConfigError("global_batch", "give exactly one of global_batch (kept at every world size) and "
                          "batch_size (per rank)")
    for name, value in (("global_batch", global_batch), ("batch_size", batch_size), ("micro_batch", micro_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(name, f"must be a positive integer, not {value!r}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, not {world_size}")
    size = global_batch if global_batch is not None else batch_size * world_size  # type: ignore[operator]
    assert size is not None
    if size < world_size:
        raise ConfigError("global_batch", f"{size} samples per step cannot be shared out among {world_size} ranks: "
                          "every rank needs at least one (a larger global_batch, or fewer ranks)")
    shape = Geometry(world_size, size, micro_batch)
    smallest = size // world_size
    if micro_batch is not None and math.ceil(smallest / micro_batch) != shape.micro_per_step:
        raise ConfigError("micro_batch", f"a step of {size} samples over {world_size} ranks gives shares of "
                          f"{smallest} and {smallest + 1}, which micro_batch {micro_batch} cuts into different numbers "
                          "of micro-batches (their collectives would not match): make global_batch a multiple of the "
                          "world size, or choose a micro_batch that divides the shares alike")
    return shape


def share(start: int, shape: Geometry, rank: int) -> range:
    """Stream positions of `rank`'s share of the step whose global batch starts at `start`."""
    if not 0 <= rank < shape.world_size:
        raise ValueError(f"rank {rank} is not in a world of {shape.world_size}")
    return range(start + rank, start + shape.global_size, shape.world_size)


def micro_batches(positions: Sequence[int], shape: Geometry) -> list[Sequence[int]]:
    """`positions` (one rank's share of a step) cut into that step's micro-batches."""
    if shape.micro_batch is None:
        return [positions]
    m = shape.micro_batch
    return [positions[i:i + m] for i in range(0, len(positions), m)]


def steps_per_pass(samples: int, shape: Geometry) -> int:
    """Steps in one pass of a loader: an epoch's worth, rounded up (at least one)."""
    return max(1, math.ceil(samples / shape.global_size))
