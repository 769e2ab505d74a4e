"""The sample ledger: what the data tests check about the sample ids a run trained on.

- `read_ledgers(folder)` (`read_ledgers_with_worlds`: and each step's world size): the
  `ledger-*.jsonl` lines every rank of every launch wrote (one line per rank per step:
  {"step", "rank", "world", "ids"}), merged into the global batch of each step:
  {step: sorted ids}. Raises when a step appears at two world sizes or a rank twice (a step trained
  twice: across a relaunch, the resumed run repeated a step the first one had finished).
- `assert_each_epoch_once(batches, samples)`: the steps are consecutive (from the first), and
  after every step every sample has been seen floor(n / samples) or that + 1 times (n samples
  so far): no sample comes a second time before every other one came once, at any step
  boundary: each epoch is each sample exactly once.
- `assert_run(...)`: all of that, for a run through given world sizes, and the global batches
  of an uninterrupted run (the global batch kept) or of each rank's batch (kept instead).
- `worlds_so_far(folder)`: {step: world} of the ledger lines written so far (a test waits on it).
- `uninterrupted(samples, seed, global_batch, steps)`: the global batches an uninterrupted run
  takes, from the definition alone (torch.randperm seeded with seed + epoch, as DistributedSampler
  seeds it, epochs end to end, cut into global batches), not from spotguard's code.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch


def read_ledgers(folder: Path) -> dict[int, list[int]]:
    return read_ledgers_with_worlds(folder)[0]


def read_ledgers_with_worlds(folder: Path) -> tuple[dict[int, list[int]], dict[int, int]]:
    """`read_ledgers`, and the world size each step was trained at."""
    return merge(json.loads(line) for path in sorted(folder.glob("ledger-*.jsonl"))
                 for line in path.read_text().splitlines())


def worlds_so_far(folder: Path) -> dict[int, int]:
    """{step: world} of the steps recorded so far (a line being written is skipped)."""
    seen = {}
    for path in folder.glob("ledger-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            seen[int(entry["step"])] = int(entry["world"])
    return seen


def merge(entries: Iterable[dict]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Ledger entries ({"step", "rank", "world", "ids"}) -> (global batch of each step, its world size)."""
    by_step: dict[int, list[int]] = {}
    worlds: dict[int, int] = {}
    ranks: dict[int, set[int]] = {}
    for entry in entries:
        step, rank = int(entry["step"]), int(entry["rank"])
        assert worlds.setdefault(step, entry["world"]) == entry["world"], f"step {step} trained at two world sizes"
        assert rank not in ranks.setdefault(step, set()), f"step {step} trained twice by rank {rank}"
        ranks[step].add(rank)
        by_step.setdefault(step, []).extend(entry["ids"])
    for step, seen in ranks.items():
        assert seen == set(range(worlds[step])), f"step {step}: ranks {sorted(seen)} of {worlds[step]} recorded it"
    return {step: sorted(ids) for step, ids in sorted(by_step.items())}, dict(sorted(worlds.items()))


def assert_run(batches: dict[int, list[int]], worlds: dict[int, int], *, steps: range, world_sizes: list[int],
               samples: int, same_as: dict[int, list[int]] | None = None, per_rank: int | None = None) -> None:
    """What every ledger test asserts of a merged ledger: every step of `steps` trained (once, by
    every rank of its world: `merge`), the world sizes went through `world_sizes` in that order,
    each epoch saw every sample once; with the global batch kept the global batches are `same_as`
    (an uninterrupted run's, numbered as `steps`), with each rank's kept each step has `per_rank`
    samples per rank."""
    assert sorted(batches) == list(steps)
    sizes = [worlds[s] for s in sorted(worlds)]
    assert [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]] == world_sizes, worlds
    assert_each_epoch_once(batches, samples)
    if same_as is not None:
        assert batches == same_as
    if per_rank is not None:
        assert [len(batches[s]) for s in batches] == [per_rank * worlds[s] for s in batches]


def assert_each_epoch_once(batches: dict[int, list[int]], samples: int) -> None:
    first = min(batches)
    missing = sorted(set(range(first, max(batches) + 1)) - set(batches))
    assert not missing, f"steps missing from the ledger: {missing}"
    counts: Counter[int] = Counter()
    seen = 0
    for step in sorted(batches):
        counts.update(batches[step])
        seen += len(batches[step])
        assert set(counts) <= set(range(samples)), f"step {step}: ids outside the dataset"
        low = seen // samples
        high = low + (1 if seen % samples else 0)
        wrong = {i: counts[i] for i in range(samples) if not low <= counts[i] <= high}
        assert not wrong, f"after step {step} ({seen} samples) these samples were seen {wrong} times, not {low}..{high}"


def uninterrupted(samples: int, seed: int, global_batch: int, steps: int, shuffle: bool = True) -> dict[int, list[int]]:
    stream: list[int] = []
    epoch = 0
    while len(stream) < steps * global_batch:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        stream += torch.randperm(samples, generator=g).tolist() if shuffle else list(range(samples))
        epoch += 1
    return {step: sorted(stream[step * global_batch:(step + 1) * global_batch]) for step in range(steps)}
