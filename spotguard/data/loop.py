"""The training loop's side of an `ElasticSampler`: steps, each with its micro-batches, from a
loader that draws from the sampler.

Contract of `training_steps(sampler, loader, start, total)` (`sampler.steps(...)`):
- Checked when called, before any batch: `loader` draws its batches from `sampler`
  (`DataLoader(dataset, batch_sampler=sampler)`; ConfigError naming the fix otherwise: a
  `DistributedSampler` or a plain sampler cannot be re-sharded), and `start` is the step the
  sampler's position belongs to (`DataPositionError` otherwise).
- Yields `(step, micro_batches)` for steps `start`..`total - 1`: the `micro_batches_per_step()`
  batches the loader yields for the step, collated as the loader collates. The sampler's position
  advances as a step is handed out, so a checkpoint taken at that step's boundary (the Guard's
  `step(step)`) holds the position after it.
- A pass of the loader covers an epoch's worth of steps; the next pass starts where the position
  is. When the world changed at a step boundary (an in-place change: the default group's rank or
  size differs from the pass's), the pass ends there and the next one re-shards the remainder
  among the new ranks: a new iterator of the same loader (with `persistent_workers` its workers
  are kept), nothing rebuilt. Batches the old iterator prefetched are dropped with it.
- The loader ending before the pass does (another batch sampler in between) raises RuntimeError.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spotguard.config import ConfigError

if TYPE_CHECKING:
    from spotguard.data.sampler import ElasticSampler, Pass


def check_loader(sampler: ElasticSampler, loader: Any) -> None:
    """ConfigError unless `loader` draws its batches from `sampler`."""
    if getattr(loader, "batch_sampler", None) is sampler:
        return
    inner = getattr(loader, "sampler", None)
    found = f"it draws from {type(inner).__name__}" if inner is not None else f"it is a {type(loader).__name__}"
    raise ConfigError("loader", f"does not draw its batches from this ElasticSampler ({found}), so its order cannot "
                      "be re-sharded when the world changes: make it DataLoader(dataset, batch_sampler=sampler)")


def training_steps(sampler: ElasticSampler, loader: Any, start: int, total: int) -> Iterator[tuple[int, list[Any]]]:
    """See the module docstring."""
    check_loader(sampler, loader)
    sampler.check_position(start)
    return _steps(sampler, loader, start, total)


def _steps(sampler: ElasticSampler, loader: Any, start: int, total: int) -> Iterator[tuple[int, list[Any]]]:
    from spotguard.data.sampler import current_world

    step = start
    while step < total:
        one = sampler.current_pass()
        batches = iter(loader)
        for _ in range(one.steps):
            micro = [_next(batches, one) for _ in range(one.shape.micro_per_step)]
            sampler.advance(one.shape)
            yield step, micro
            step += 1
            if step >= total or current_world() != (one.rank, one.shape.world_size):
                break
        del batches  # a multi-process iterator shuts its workers down here, before the next one starts


def _next(batches: Iterator[Any], one: Pass) -> Any:
    try:
        return next(batches)
    except StopIteration:
        raise RuntimeError(f"the loader ended inside a pass of {one.steps} steps: does something between the "
                           "DataLoader and the ElasticSampler drop batches?") from None
