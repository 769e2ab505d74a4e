"""Denser snapshots while a notice is armed: the rule (hooks/snapshot_grid.py) as tables, and the
grid shared by two ranks' `DenseSnapshots` through a real TCPStore (hooks/dense_snapshots.py),
driven boundary by boundary: every rank snapshots the same steps, or none of the grid's."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

from spotguard.hooks import dense_snapshots
from spotguard.hooks.adapters.plain_torch import PlainTorchAdapter
from spotguard.hooks.deadline_claims import LocalClaims, StoreClaims
from spotguard.hooks.dense_snapshots import DenseSnapshots, measured_copy_seconds
from spotguard.hooks.snapshot_grid import (COPY_BUDGET, LEAD_SECONDS, MAX_ATTEMPTS, MEET_SECONDS, MIN_LEAD_STEPS, Grid,
                                           dense_interval, in_time, lead_steps, propose)


@pytest.mark.parametrize("copy, step, every, expected", [
    (0.001, 0.05, 25, 1),       # a copy well under the budget: every step
    (0.005, 0.05, 25, 1),       # exactly the budget
    (0.0051, 0.05, 25, 2),
    (0.5, 1.0, 25, 5),          # 0.5 s copies, 1 s steps: every 5th step costs 10%
    (2.4, 1.0, 25, 24),
    (2.5, 1.0, 25, None),       # not denser than the periodic snapshots
    (0.001, 0.05, 1, None),     # snapshots every step already
    (None, 0.05, 25, None),     # no copy measured yet
    (0.001, 0.0, 25, None),     # no step time measured yet
])
def test_dense_interval(copy, step, every, expected):
    assert dense_interval(copy, step, every) == expected


@pytest.mark.parametrize("step, attempt, expected", [
    (0.05, 0, math.ceil(LEAD_SECONDS / 0.05)),
    (0.05, 1, math.ceil(2 * LEAD_SECONDS / 0.05)),   # a later attempt starts further ahead
    (10.0, 0, MIN_LEAD_STEPS),                        # long steps: a few steps
])
def test_lead_steps(step, attempt, expected):
    assert lead_steps(step, attempt) == expected


def test_propose_starts_a_lead_after_the_completed_step_or_says_none():
    grid = propose("n", completed=60, copy_seconds=0.001, step_seconds=0.05, every=25)
    assert grid == Grid("n", 60 + lead_steps(0.05), 1, 0) and grid.dense
    assert propose("n", completed=None, copy_seconds=0.001, step_seconds=10.0, every=25).start == MIN_LEAD_STEPS - 1
    none = propose("n", completed=60, copy_seconds=None, step_seconds=0.05, every=25, attempt=2)
    assert (none.dense, none.attempt, none.takes(80)) == (False, 2, False)
    assert Grid.from_wire("n", 1, grid.to_wire()) == Grid("n", grid.start, 1, 1)


@pytest.mark.parametrize("step, expected", [(69, False), (70, True), (71, False), (72, False), (73, True), (100, True)])
def test_takes(step, expected):
    assert Grid("n", 70, 3).takes(step) is expected


@pytest.mark.parametrize("boundary, expected", [(60, True), (69, True), (70, False), (71, False)])
def test_in_time(boundary, expected):
    assert in_time(boundary, Grid("n", 70, 1)) is expected


def test_copy_budget_is_a_tenth():
    assert COPY_BUDGET == 0.1  # docs/protocols.md states it


# ---- two ranks through a real store ----------------------------------------------------------------
EVERY = 25
STEP = 0.05  # seconds per step: a grid starts lead_steps(STEP) steps ahead


COPY = 0.001  # seconds per snapshot copy, as the grids below assume: one every step


@pytest.fixture
def adapter(tmp_path, monkeypatch):
    """A real adapter with a measured copy, read as `COPY`: a copy measured on a loaded machine
    (17 ms seen) would make the grid sparser than the steps these tests name."""
    model = torch.nn.Linear(8, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "ckpt")
    adapter.snapshot(0)  # a measured copy
    measured = dense_snapshots.measured_copy_seconds
    monkeypatch.setattr(dense_snapshots, "measured_copy_seconds",
                        lambda of: COPY if of is adapter and measured(of) is not None else measured(of))
    yield adapter
    adapter.close()


@pytest.fixture
def ranks():
    server = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, False)
    yield [DenseSnapshots(lambda: StoreClaims(server, 0, 2)), DenseSnapshots(lambda: StoreClaims(client, 1, 2))]


def lockstep(ranks: list[DenseSnapshots], steps: range, held: dict[int, int] | None = None) -> list[list[int]]:
    """The steps each rank snapshots at these boundaries (as `Guard.step` decides): one thread a
    rank, each step a barrier first (as the collective in every training step keeps ranks
    together). `held`: rank -> a step whose boundary that rank never reaches (held after the
    step's collective, as a rank-0 evaluation before `guard.step`)."""
    taken: list[list[int]] = [[] for _ in ranks]
    collective = threading.Barrier(len(ranks))
    boundary_passed = [threading.Event() for _ in ranks]  # at the held step

    def run(index: int) -> None:
        rank = ranks[index]
        for step in steps:
            try:
                collective.wait(timeout=60)
            except threading.BrokenBarrierError:
                return  # a peer was held at its boundary: this one's next collective waits for good
            if (held or {}).get(index) == step:
                for other, passed in enumerate(boundary_passed):
                    assert other == index or passed.wait(60)
                collective.abort()
                return
            if rank.due(step, EVERY) if rank.grid is not None else step % EVERY == 0:
                taken[index].append(step)
            if held and step in held.values():
                boundary_passed[index].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return taken


def test_the_measured_copy_is_the_adapters(adapter):
    copy = measured_copy_seconds(adapter)
    assert copy is not None and 0 < copy == adapter.save_parts().snapshot
    assert measured_copy_seconds(None) is None


def test_ranks_that_see_the_grid_in_time_snapshot_the_same_steps(ranks, adapter):
    first, second = ranks
    first.follow("n", adapter, 60, STEP, EVERY)           # the rank that got the notice proposes
    second.follow("n", adapter, 61, STEP, EVERY)          # a peer a step ahead: its proposal loses
    assert first.grid == second.grid and first.grid.start == 60 + lead_steps(STEP)
    start = first.grid.start
    assert lockstep(ranks, range(62, start + 5)) == [[75, *range(start, start + 5)]] * 2   # 75: periodic
    second.follow("n", adapter, start + 5, STEP, EVERY)   # later polls change nothing
    assert second.grid == first.grid


def test_a_rank_that_saw_the_grid_too_late_makes_every_rank_skip_it_until_a_later_one(ranks, adapter):
    first, second = ranks
    first.follow("n", adapter, 60, STEP, EVERY)
    start = first.grid.start
    assert lockstep(ranks, range(61, start)) == [[75], [75]]   # the first acknowledged in time; periodic only
    second.follow("n", adapter, start, STEP, EVERY)       # learned of it at its boundary of `start`
    assert lockstep(ranks, range(start, start + 3)) == [[], []]   # the same count: not every rank in time
    assert first.failed == first.grid and second.failed == second.grid
    second.follow("n", adapter, start + 3, STEP, EVERY)   # the next attempt, further ahead
    first.follow("n", adapter, start + 3, STEP, EVERY)
    retry = first.grid
    assert retry == second.grid and retry.attempt == 1 and retry.start == start + 3 + lead_steps(STEP, 1)
    assert lockstep(ranks, range(start + 3, retry.start + 2)) == [[100, retry.start, retry.start + 1]] * 2


def test_after_max_attempts_the_periodic_snapshots_only(ranks, adapter):
    first, second = ranks
    for attempt in range(MAX_ATTEMPTS):
        first.follow("n", adapter, 0, STEP, EVERY)
        grid = first.grid
        assert grid is not None and grid.attempt == attempt
        assert lockstep(ranks, range(grid.start - 1, grid.start)) == [[], []]
        second.follow("n", adapter, grid.start, STEP, EVERY)   # always too late
        assert lockstep(ranks, range(grid.start, grid.start + 1)) == [[], []]
    first.follow("n", adapter, 0, STEP, EVERY)
    assert first.grid is None
    first.follow("n", adapter, 0, STEP, EVERY)             # settled: no new proposal
    assert first.grid is None


def test_a_stopped_grid_ends_at_the_next_periodic_step(ranks, adapter):
    first, second = ranks
    first.follow("n", adapter, 60, STEP, EVERY)
    second.follow("n", adapter, 60, STEP, EVERY)
    start = first.grid.start
    assert lockstep(ranks, range(61, start + 2)) == [[75, start, start + 1]] * 2
    first.stop()                                           # withdrawn: this rank learns first ...
    assert lockstep(ranks, range(start + 2, start + 4)) == [[start + 2, start + 3]] * 2   # ... and goes on
    second.stop()
    periodic = (start // EVERY + 1) * EVERY
    assert lockstep(ranks, range(start + 4, periodic + 3)) == [list(range(start + 4, periodic + 1))] * 2
    assert first.grid is None and second.grid is None      # from the periodic step on: as before the notice


def test_no_measured_copy_means_no_grid_for_that_notice(tmp_path):
    model = torch.nn.Linear(8, 4)
    adapter = PlainTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path / "c")
    dense = DenseSnapshots(LocalClaims)
    dense.follow("n", adapter, 60, STEP, EVERY)
    assert dense.grid is None
    adapter.snapshot(1)
    dense.follow("n", adapter, 61, STEP, EVERY)            # settled for this notice
    assert dense.grid is None
    dense.stop()
    dense.follow("m", adapter, 62, STEP, EVERY)            # the next notice measures again
    assert dense.grid is not None and dense.grid.start == 62 + lead_steps(STEP)
    adapter.close()


def test_a_rank_held_before_its_boundary_keeps_its_peer_from_a_step_it_does_not_hold(ranks, adapter):
    """Rank 0 is held after step start+2's collective, before its boundary; rank 1 reaches that
    boundary, waits MEET_SECONDS for it and does not snapshot it: both hold start+1."""
    for rank in ranks:
        rank.follow("n", adapter, 60, STEP, EVERY)
    start = ranks[0].grid.start
    t0 = time.monotonic()
    taken = lockstep(ranks, range(61, start + 5), held={0: start + 2})
    assert taken == [[75, start, start + 1]] * 2
    assert time.monotonic() - t0 >= MEET_SECONDS
    assert ranks[1].failed == ranks[1].grid        # the watchdog proposes a later grid
    assert lockstep([ranks[1]], range(start + 3, start + 5)) == [[]]   # no grid step without the peer


def test_a_re_formed_group_ends_the_grid_at_once_and_a_notice_still_armed_gets_a_new_one(ranks, adapter):
    for rank in ranks:
        rank.follow("n", adapter, 60, STEP, EVERY)
    start = ranks[0].grid.start
    assert lockstep(ranks, range(61, start + 2)) == [[75, start, start + 1]] * 2
    for rank in ranks:
        rank.end()                                          # the same agreed step on every rank
    assert [rank.grid for rank in ranks] == [None, None]
    assert lockstep(ranks, range(start + 2, 101)) == [[100]] * 2   # at once, no meeting (the joiners know none)
    alone = DenseSnapshots(LocalClaims)                     # the new formation's store has no grid yet
    alone.follow("n", adapter, 60, STEP, EVERY)
    alone.end()
    alone.follow("n", adapter, 101, STEP, EVERY)            # still armed: a new grid
    assert alone.grid is not None and alone.grid.start == 101 + lead_steps(STEP)
