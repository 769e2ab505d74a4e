"""`ElasticSampler`: every sample exactly once per epoch at any world size, through membership
changes, restarts and prefetching loaders.

    sampler = ElasticSampler(dataset, global_batch=32, micro_batch=8, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    adapter = TorchDCPAdapter(model, optimizer, checkpoint_dir="/ckpt", build=build, data=sampler)
    guard = Guard.from_env(adapter=adapter)
    start = guard.resume()                       # the sampler's position comes back with the checkpoint
    for step, micro_batches in sampler.steps(loader, start, total):
        ...one forward/backward per micro-batch, optimizer.step()...
        guard.step(step)

Contract:
- Position: `consumed`, the samples all ranks together consumed since the first step, across
  epochs, over the stream of the epochs' orders (`order.EpochOrder`, seeded like
  `DistributedSampler`); `steps_done`, the optimizer steps that consumed them. It advances by one
  global batch per optimizer step, when the step is handed to the training loop (`steps()`) or
  when a framework integration reports the step done (`advance()`), never by what a loader
  prefetched: a loader with workers runs ahead of it by its prefetch depth, and that is not
  consumption. `state_dict()` is that position (JSON: a few integers); the adapters
  (`data=sampler`) and the integrations keep it in every checkpoint and hand it to a joiner.
- Sharing out: each pass of a loader (`iter(sampler)`) starts at the position and deals the next
  global batches (plan.py) to the ranks of the current default process group, read when the pass
  starts; after a world-size change the next pass re-shards the remainder. `steps()` starts a new
  pass by itself when the world changed at a step boundary (in place), without rebuilding the
  loader: only its iterator is replaced.
- `global_order()`: the same stream as one sequence of indices (a `Sampler[int]`) for frameworks
  that deal batches to ranks themselves (Accelerate's `prepare`, the Hugging Face Trainer).
- Bad input: an IterableDataset (no indices to deal out), a dataset whose length changes
  (`DatasetLengthChanged` when it is noticed: at each pass, each step and each load), a
  checkpoint's position made for another order, and a loop that starts at a step the sampler has
  not counted (`DataPositionError`: its position was not restored with the checkpoint) raise
  errors that say what to change; nothing continues in a silently wrong order.
"""
from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, Sampler

from spotguard.config import ConfigError
from spotguard.data import plan
from spotguard.data.order import EpochOrder

STATE_VERSION = 1


class DatasetLengthChanged(ValueError):
    """The dataset's length is not the one the sampler's order and position are over."""


class DataPositionError(RuntimeError):
    """Training starts at a step the sampler's position does not belong to."""


@dataclass(frozen=True)
class Pass:
    """One pass of a loader over the stream, fixed when it starts."""

    start: int  # stream position of its first step's global batch
    rank: int
    shape: plan.Geometry
    steps: int


def current_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ElasticSampler(Sampler[list[int]]):
    """See the module docstring. A batch sampler: `DataLoader(dataset, batch_sampler=sampler)`."""

    def __init__(self, data: Sized | int, *, global_batch: int | None = None, batch_size: int | None = None,
                 micro_batch: int | None = None, seed: int = 0, shuffle: bool = True):
        """`data`: a map-style dataset (or its length). `global_batch`: samples per optimizer step
        at every world size; or `batch_size`: samples per rank per step (the global batch then
        grows and shrinks with the world). `micro_batch`: at most this many samples per batch the
        loader yields (a step is then several micro-batches: gradient accumulation)."""
        self._dataset = None if isinstance(data, int) else data
        self.samples = _length_of(data)
        plan.geometry(1, global_batch=global_batch, batch_size=batch_size, micro_batch=micro_batch)  # checks
        self.global_batch, self.batch_size, self.micro_batch = global_batch, batch_size, micro_batch
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.order = EpochOrder(self.samples, self.seed, self.shuffle)
        self.consumed = 0
        self.steps_done = 0

    # ---- geometry --------------------------------------------------------------------------
    def geometry(self, world_size: int | None = None) -> plan.Geometry:
        """How a step takes its samples at `world_size` (default: the current world)."""
        size = current_world()[1] if world_size is None else world_size
        return plan.geometry(size, global_batch=self.global_batch, batch_size=self.batch_size,
                             micro_batch=self.micro_batch)

    def micro_batches_per_step(self, world_size: int | None = None) -> int:
        """Batches each rank's loader yields per optimizer step (the gradient accumulation)."""
        return self.geometry(world_size).micro_per_step

    @property
    def epoch(self) -> int:
        """The epoch the next sample to consume belongs to."""
        return self.consumed // self.samples

    def current_pass(self, world: tuple[int, int] | None = None) -> Pass:
        """The pass a loader would start now: from the position, for (rank, world size) `world`
        (default: this process in the current default group)."""
        self.check_length()
        rank, world_size = current_world() if world is None else world
        shape = self.geometry(world_size)
        return Pass(self.consumed, rank, shape, plan.steps_per_pass(self.samples, shape))

    # ---- position --------------------------------------------------------------------------
    def advance(self, shape: plan.Geometry | None = None) -> None:
        """One optimizer step consumed its global batch (at `shape`, default the current world's)."""
        self.check_length()
        self.consumed += (shape or self.geometry()).global_size
        self.steps_done += 1

    def check_position(self, start: int) -> None:
        """Raises DataPositionError unless `start` (the steps already done) is where the sampler is."""
        if start != self.steps_done:
            raise DataPositionError(
                f"training starts at step {start} but the sampler has counted {self.steps_done} steps: its position "
                "was not restored with the checkpoint (hand the sampler to the adapter, data=sampler; or to the "
                "integration, sampler=sampler) or it was advanced outside the training loop")

    def check_length(self) -> None:
        if self._dataset is not None and len(self._dataset) != self.samples:
            raise DatasetLengthChanged(
                f"the dataset now has {len(self._dataset)} samples, but this sampler's order and position are over "
                f"{self.samples}: a dataset must keep its length while a sampler deals it out (make a new "
                "ElasticSampler, and a new run, for a changed dataset)")

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "samples": self.samples, "seed": self.seed, "shuffle": self.shuffle,
                "consumed": self.consumed, "steps": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a position from `state_dict()`; raises when it was made for another order."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown ElasticSampler state version {state.get('version')!r} (this is {STATE_VERSION})")
        if int(state["samples"]) != self.samples:
            raise DatasetLengthChanged(
                f"the checkpoint's data position is over {state['samples']} samples, this sampler's dataset has "
                f"{self.samples}: resume with the same dataset (a changed dataset needs a new run)")
        for name in ("seed", "shuffle"):
            if state[name] != getattr(self, name):
                raise ConfigError(name, f"the checkpoint's data order was made with {name}={state[name]!r}, this "
                                  f"sampler has {getattr(self, name)!r}: resume with the same {name}")
        consumed, steps = int(state["consumed"]), int(state["steps"])
        if consumed < 0 or steps < 0:
            raise ValueError(f"a data position cannot be negative: {state!r}")
        self.consumed, self.steps_done = consumed, steps

    # ---- the loader's side ------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches of sample indices for one pass from the position (fixed now:
        a loader's workers may run ahead of the training loop without moving the position)."""
        return self.batches(self.current_pass())

    def batches(self, one: Pass) -> Iterator[list[int]]:
        """The micro-batches of sample indices `one` deals to its rank, step after step."""
        at = self.order.at
        for step in range(one.steps):
            start = one.start + step * one.shape.global_size
            for positions in plan.micro_batches(plan.share(start, one.shape, one.rank), one.shape):
                yield [at(p) for p in positions]

    def __len__(self) -> int:
        one = self.current_pass()
        return one.steps * one.shape.micro_per_step

    def set_epoch(self, epoch: int) -> None:
        """Accepted and ignored: the epoch follows from the position (frameworks call this)."""

    def global_order(self) -> GlobalOrder:
        """This sampler's stream as one `Sampler[int]`, for frameworks that deal batches out themselves."""
        return GlobalOrder(self)

    def steps(self, loader: Any, start: int, total: int) -> Iterator[tuple[int, list[Any]]]:
        """`(step, micro_batches)` for steps `start`..`total - 1` from `loader` (a DataLoader made
        with `batch_sampler=` this sampler); see `spotguard.data.loop`."""
        from spotguard.data.loop import training_steps

        return training_steps(self, loader, start, total)


class GlobalOrder(Sampler[int]):
    """`ElasticSampler.global_order()`: one pass of the stream as a sequence of indices, the
    ranks' shares not cut out (the framework deals its batches to the ranks). The position is the
    ElasticSampler's; it advances when the integration reports a step done."""

    def __init__(self, sampler: ElasticSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        one = self.sampler.current_pass()
        at = self.sampler.order.at
        return (at(p) for p in range(one.start, one.start + one.steps * one.shape.global_size))

    def __len__(self) -> int:
        one = self.sampler.current_pass()
        return one.steps * one.shape.global_size

    def set_epoch(self, epoch: int) -> None:
        """Accepted and ignored: the epoch follows from the position."""


def _length_of(data: Sized | int) -> int:
    if isinstance(data, IterableDataset):
        raise TypeError(
            "ElasticSampler needs a map-style dataset (indices it can deal out); an IterableDataset has none. Give the "
            "iterable's position to the checkpoint through its own state_dict (torchdata's StatefulDataLoader) and "
            "see the README's 'Data' section for what can be promised then")
    if isinstance(data, bool) or not isinstance(data, (int, Sized)):
        raise TypeError(f"ElasticSampler needs a map-style dataset or its length, not {type(data).__name__}")
    samples = data if isinstance(data, int) else len(data)
    if samples < 1:
        raise ConfigError("data", f"has {samples} samples: nothing to deal out")
    return samples


__all__ = ["DataPositionError", "DatasetLengthChanged", "ElasticSampler", "GlobalOrder", "Pass", "current_world"]
