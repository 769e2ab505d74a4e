"""The elastic sampler's arithmetic (spotguard/data/plan.py): a table of geometries, and the
shares checked against torch's own DistributedSampler."""
from __future__ import annotations

import pytest
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from spotguard.config import ConfigError
from spotguard.data import plan

GEOMETRIES = [
    # world, kwargs, (samples per step, micro-batches per step) or the field a ConfigError names
    (1, {"global_batch": 32}, (32, 1)),
    (4, {"global_batch": 32}, (32, 1)),
    (4, {"global_batch": 32, "micro_batch": 3}, (32, 3)),  # shares of 8: 3 + 3 + 2
    (3, {"global_batch": 32}, (32, 1)),  # shares of 11, 11, 10: one batch each
    (3, {"global_batch": 32, "micro_batch": 4}, (32, 3)),  # 11 -> 4+4+3, 10 -> 4+4+2: alike
    (3, {"global_batch": 32, "micro_batch": 5}, "micro_batch"),  # 11 -> 3 batches, 10 -> 2: collectives differ
    (3, {"global_batch": 32, "micro_batch": 10}, "micro_batch"),
    (3, {"batch_size": 8}, (24, 1)),
    (3, {"batch_size": 8, "micro_batch": 3}, (24, 3)),
    (5, {"global_batch": 4}, "global_batch"),  # a rank would get nothing
    (1, {}, "global_batch"),
    (1, {"global_batch": 8, "batch_size": 2}, "global_batch"),
    (1, {"global_batch": 0}, "global_batch"),
    (1, {"batch_size": 2.5}, "batch_size"),
    (1, {"global_batch": 8, "micro_batch": 0}, "micro_batch"),
    (1, {"global_batch": True}, "global_batch"),
]


@pytest.mark.parametrize("world, kwargs, expected", GEOMETRIES)
def test_geometry(world, kwargs, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as caught:
            plan.geometry(world, **kwargs)
        assert caught.value.field == expected
        return
    shape = plan.geometry(world, **kwargs)
    assert (shape.global_size, shape.micro_per_step) == expected
    for rank in range(world):  # every rank runs the same number of micro-batches, none empty
        cut = plan.micro_batches(plan.share(0, shape, rank), shape)
        assert len(cut) == shape.micro_per_step and all(len(m) > 0 for m in cut)
        assert all(len(m) <= (shape.micro_batch or len(m)) for m in cut)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("start", [0, 7, 1000])
def test_the_ranks_shares_are_the_global_batch_once(world, start):
    shape = plan.geometry(world, global_batch=40)
    dealt = [p for rank in range(world) for p in plan.share(start, shape, rank)]
    assert sorted(dealt) == list(range(start, start + 40))


@pytest.mark.parametrize("world, per_rank", [(1, 4), (2, 4), (3, 2), (4, 3)])
def test_one_world_deals_what_distributed_sampler_deals(world, per_rank):
    """Per rank and per step, the same samples as DistributedSampler + BatchSampler when the epoch
    length is a multiple of the global batch (no padding on either side)."""
    samples = 4 * world * per_rank
    dataset = list(range(samples))
    shape = plan.geometry(world, batch_size=per_rank)
    order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    permutation = list(order)
    for rank in range(world):
        theirs = list(BatchSampler(DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=3),
                                   per_rank, drop_last=False))
        ours = [[permutation[p] for p in plan.share(step * shape.global_size, shape, rank)]
                for step in range(plan.steps_per_pass(samples, shape))]
        assert ours == theirs


def test_steps_per_pass_covers_an_epoch():
    shape = plan.geometry(2, global_batch=12)
    assert [plan.steps_per_pass(n, shape) for n in (1, 12, 13, 24, 96, 100)] == [1, 1, 2, 2, 8, 9]
