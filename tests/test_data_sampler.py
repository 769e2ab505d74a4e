"""ElasticSampler in one process: the dealing at any sequence of world sizes (every rank's pass
computed as that rank computes it), its position through a prefetching DataLoader, its state, and
the bad input it refuses. The real multi-process runs are in tests/test_data_ledger.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from spotguard.config import ConfigError
from spotguard.data import DataPositionError, DatasetLengthChanged, ElasticSampler
from tests.ledger import assert_each_epoch_once, uninterrupted


def run_worlds(sampler: ElasticSampler, worlds: list[int]) -> dict[int, list[int]]:
    """Trains one step per entry of `worlds` at that world size (each rank's micro-batches from the
    pass it would start at that step), advancing as the training loop does; the global batches."""
    batches = {}
    for step, world in enumerate(worlds):
        ids = []
        for rank in range(world):
            one = sampler.current_pass((rank, world))
            step_batches = sampler.batches(one)
            ids += [i for _ in range(one.shape.micro_per_step) for i in next(step_batches)]
        sampler.advance(sampler.geometry(world))
        batches[step] = sorted(ids)
    return batches


@settings(max_examples=60, deadline=None)
@given(samples=st.integers(5, 60), global_batch=st.integers(1, 24), micro=st.one_of(st.none(), st.integers(1, 6)),
       worlds=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_a_constant_global_batch_gives_the_uninterrupted_run_at_any_sequence_of_worlds(samples, global_batch, micro,
                                                                                       worlds):
    worlds = [w for w in worlds if w <= global_batch and (micro is None or global_batch % w == 0)] or [1]
    sampler = ElasticSampler(samples, global_batch=global_batch, micro_batch=micro, seed=11)
    got = run_worlds(sampler, worlds)
    assert got == uninterrupted(samples, 11, global_batch, len(worlds))
    assert_each_epoch_once(got, samples)
    assert sampler.state_dict()["consumed"] == global_batch * len(worlds)


@settings(max_examples=60, deadline=None)
@given(samples=st.integers(5, 60), per_rank=st.integers(1, 8),
       worlds=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_a_per_rank_batch_sees_every_sample_once_per_epoch_at_any_sequence_of_worlds(samples, per_rank, worlds):
    sampler = ElasticSampler(samples, batch_size=per_rank, seed=5)
    got = run_worlds(sampler, worlds)
    assert [len(got[s]) for s in got] == [per_rank * w for w in worlds]
    assert_each_epoch_once(got, samples)


def test_the_epoch_order_is_distributed_samplers():
    data = list(range(17))
    sampler = ElasticSampler(data, global_batch=17, seed=4)
    for epoch in range(3):
        theirs = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4)
        theirs.set_epoch(epoch)
        assert next(iter(sampler)) == list(theirs)
        sampler.advance()
    assert sampler.epoch == 3


def test_unshuffled_order_and_passes_of_an_epoch():
    sampler = ElasticSampler(10, global_batch=4, shuffle=False)
    assert len(sampler) == 3 and list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    for _ in range(3):
        sampler.advance()
    assert next(iter(sampler)) == [2, 3, 4, 5] and sampler.epoch == 1  # the next pass starts at the position


def samples(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_position_counts_steps_handed_out_not_what_the_workers_prefetched(workers):
    data = samples(20)
    sampler = ElasticSampler(data, global_batch=6, micro_batch=2, seed=1)
    loader = DataLoader(data, batch_sampler=sampler, num_workers=workers, prefetch_factor=4 if workers else None)
    expected = uninterrupted(20, 1, 6, 9)
    seen = {}
    for step, micro in sampler.steps(loader, 0, 9):
        assert len(micro) == 3
        seen[step] = sorted(i for batch in micro for i in batch[0].tolist())
        assert sampler.state_dict()["consumed"] == 6 * (step + 1) and sampler.steps_done == step + 1
    assert seen == expected


def test_a_resumed_sampler_continues_the_uninterrupted_order():
    data = samples(14)
    first = ElasticSampler(data, batch_size=4, seed=2)
    loader = DataLoader(data, batch_sampler=first)
    before = {s: sorted(b[0][0].tolist()) for s, b in first.steps(loader, 0, 5)}
    second = ElasticSampler(data, batch_size=4, seed=2)
    second.load_state_dict(first.state_dict())
    after = {s: sorted(b[0][0].tolist()) for s, b in second.steps(DataLoader(data, batch_sampler=second), 5, 9)}
    assert {**before, **after} == uninterrupted(14, 2, 4, 9)


def test_a_loop_at_a_step_the_sampler_did_not_count_refuses_to_start():
    data = samples(8)
    sampler = ElasticSampler(data, global_batch=2)
    with pytest.raises(DataPositionError, match="starts at step 3 but the sampler has counted 0 steps"):
        sampler.steps(DataLoader(data, batch_sampler=sampler), 3, 10)


@pytest.mark.parametrize("make, found", [
    (lambda data, sampler: DataLoader(data, sampler=DistributedSampler(data, num_replicas=1, rank=0), batch_size=2),
     "DistributedSampler"),
    (lambda data, sampler: DataLoader(data, batch_size=2), "SequentialSampler"),
    (lambda data, sampler: [[0, 1]], "it is a list"),
])
def test_a_loader_that_does_not_draw_from_the_sampler_is_refused(make, found):
    data = samples(8)
    sampler = ElasticSampler(data, global_batch=2)
    with pytest.raises(ConfigError, match=found) as caught:
        sampler.steps(make(data, sampler), 0, 10)
    assert caught.value.field == "loader" and "batch_sampler=sampler" in str(caught.value)


class Growing(Dataset):
    def __init__(self, n: int):
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return self.items[i]


def test_a_dataset_whose_length_changes_is_refused():
    data = Growing(10)
    sampler = ElasticSampler(data, global_batch=5)
    steps = sampler.steps(DataLoader(data, batch_sampler=sampler), 0, 10)
    next(steps)
    data.items.append(10)
    with pytest.raises(DatasetLengthChanged, match="now has 11 samples, but this sampler's order and position are "
                                                   "over 10"):
        next(steps)
    with pytest.raises(DatasetLengthChanged):
        list(sampler)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


def test_an_iterable_dataset_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"map-style dataset.*StatefulDataLoader"):
        ElasticSampler(Stream(), global_batch=2)


STATE = {"version": 1, "samples": 10, "seed": 0, "shuffle": True, "consumed": 12, "steps": 3}


@pytest.mark.parametrize("change, error, match", [
    ({"samples": 11}, DatasetLengthChanged, "over 11 samples, this sampler's dataset has 10"),
    ({"seed": 1}, ConfigError, "made with seed=1"),
    ({"shuffle": False}, ConfigError, "made with shuffle=False"),
    ({"version": 2}, ValueError, "unknown ElasticSampler state version 2"),
    ({"consumed": -1}, ValueError, "cannot be negative"),
])
def test_a_position_made_for_another_order_is_refused(change, error, match):
    sampler = ElasticSampler(10, global_batch=4)
    with pytest.raises(error, match=match):
        sampler.load_state_dict({**STATE, **change})
    assert (sampler.consumed, sampler.steps_done) == (0, 0)  # nothing taken from it
    sampler.load_state_dict(STATE)
    assert sampler.state_dict() == STATE and sampler.epoch == 1


def test_the_global_order_is_the_same_stream_for_frameworks_that_deal_batches_themselves():
    sampler = ElasticSampler(10, global_batch=4, seed=3)
    order = sampler.global_order()
    stream = [i for step in sorted(uninterrupted(10, 3, 4, 3)) for i in uninterrupted(10, 3, 4, 3)[step]]
    assert len(order) == 12 and sorted(order) == sorted(stream)
    sampler.advance()
    assert list(order)[:4] == next(iter(sampler))  # the pass starts at the position, as the batch sampler's


def test_set_epoch_is_accepted_and_changes_nothing():
    sampler = ElasticSampler(10, global_batch=4, seed=3)
    first = list(sampler)
    sampler.set_epoch(5)
    sampler.global_order().set_epoch(5)
    assert list(sampler) == first
