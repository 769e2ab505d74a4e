"""The reshard plan as tables: who sends which rows to whom, for FSDP2 (chunk pieces), DDP
replicas, HSDP and DeepSpeed ZeRO's flat partitions, shrinks, grows and replacements, and the
layouts it refuses."""
from __future__ import annotations

import pytest

from spotguard.hooks.elastic.reshard_plan import (REPLICATE, SHARD0, Keep, Layout, Move, Relay, ReshardError,
                                                  ReshardPlan, TensorSpec, held_rows, zero_partition)


def spec(rows: int, layout: Layout, name: str = "w", row_bytes: int = 4) -> TensorSpec:
    return TensorSpec(name, rows, row_bytes, layout)


@pytest.mark.parametrize("rows, world, pieces", [
    (16, 4, [(0, 4), (4, 8), (8, 12), (12, 16)]),
    (16, 3, [(0, 6), (6, 12), (12, 16)]),
    (4, 3, [(0, 2), (2, 4), (4, 4)]),  # torch.chunk: 2 pieces of 2, the third rank holds nothing
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_shard0_pieces_are_torch_chunks(rows, world, pieces):
    assert [held_rows(Layout.sharded(world), rows, r) for r in range(world)] == pieces


def test_shrink_4_to_3_leaving_rank_sends_its_rows_survivors_keep_theirs():
    # rows 12: old pieces of 3, new pieces of 4; old rank 3 leaves
    plan = ReshardPlan.make([spec(12, Layout.sharded(4))], 4, 3, {0: 0, 1: 1, 2: 2})
    assert plan.keeps == (Keep(0, 0, 0, 0, 3), Keep(0, 1, 1, 4, 6), Keep(0, 2, 2, 8, 9))
    assert plan.moves == (Move(0, 1, 0, 3, 4), Move(0, 2, 1, 6, 8), Move(0, 3, 2, 9, 12))
    assert plan.moved_bytes() == plan.minimum_bytes() == 6 * 4


def test_grow_3_to_4_joiner_gets_rows_from_survivors_only():
    plan = ReshardPlan.make([spec(12, Layout.sharded(3))], 3, 4, {0: 0, 1: 1, 2: 2})
    assert plan.keeps == (Keep(0, 0, 0, 0, 3), Keep(0, 1, 1, 4, 6), Keep(0, 2, 2, 8, 9))
    assert plan.moves == (Move(0, 0, 1, 3, 4), Move(0, 1, 2, 6, 8), Move(0, 2, 3, 9, 12))
    assert plan.moved_bytes() == plan.minimum_bytes()


def test_renumbered_survivors_keep_their_rows_under_their_new_rank():
    # old rank 0 leaves, 1 -> 0, 2 -> 1
    plan = ReshardPlan.make([spec(6, Layout.sharded(3))], 3, 2, {1: 0, 2: 1})
    assert plan.keeps == (Keep(0, 1, 0, 2, 3), Keep(0, 2, 1, 4, 6))
    assert plan.moves == (Move(0, 0, 0, 0, 2), Move(0, 1, 1, 3, 4))


def test_replica_joiners_each_receive_the_whole_replica_from_one_survivor():
    plan = ReshardPlan.make([spec(10, Layout.replicated(2), row_bytes=8)], 2, 4, {0: 0, 1: 1})
    assert plan.keeps == (Keep(0, 0, 0, 0, 10), Keep(0, 1, 1, 0, 10))
    assert plan.moves == (Move(0, 0, 2, 0, 10), Move(0, 1, 3, 0, 10))  # spread over the survivors
    assert plan.moved_bytes() == plan.minimum_bytes() == 2 * 80


def test_replica_shrink_moves_nothing():
    plan = ReshardPlan.make([spec(10, Layout.replicated(3))], 3, 2, {0: 0, 2: 1})
    assert plan.moves == () and plan.minimum_bytes() == 0


def test_scalars_are_one_row_replicas():
    plan = ReshardPlan.make([spec(1, Layout.replicated(1), name="step")], 1, 2, {0: 0})
    assert plan.moves == (Move(0, 0, 1, 0, 1),)


def test_hsdp_grow_adds_a_replica_and_keeps_the_shard_count():
    old = Layout((1, 2), (REPLICATE, SHARD0))
    plan = ReshardPlan.make([spec(8, old)], 2, 4, {0: 0, 1: 1})
    assert plan.new_layouts == (Layout((2, 2), (REPLICATE, SHARD0)),)
    assert plan.moves == (Move(0, 0, 2, 0, 4), Move(0, 1, 3, 4, 8))


def test_replacement_relays_a_leavers_rows_to_the_joiner_through_a_survivor():
    # 2 -> 2: old rank 1 leaves, new rank 1 joins and needs exactly the rows only it held
    plan = ReshardPlan.make([spec(4, Layout.sharded(2))], 2, 2, {0: 0})
    assert plan.keeps == (Keep(0, 0, 0, 0, 2),) and plan.moves == ()
    assert plan.relays == (Relay(0, 1, 0, 1, 2, 4),)  # from old rank 1, via old rank 0, to new rank 1
    assert plan.minimum_bytes() == 2 * 4 and plan.moved_bytes() == 2 * plan.minimum_bytes()


def test_replacement_of_a_replica_comes_from_a_survivor():
    plan = ReshardPlan.make([spec(4, Layout.replicated(2))], 2, 2, {0: 0})
    assert plan.moves == (Move(0, 0, 1, 0, 4),)


def zero(world: int) -> Layout:
    return Layout((world,), (zero_partition(2),))


@pytest.mark.parametrize("rows, world, pieces", [
    (10, 3, [(0, 4), (4, 8), (8, 10)]),  # ceil(10 / 6) * 2 = 4 items a rank; the last holds 2 and 2 of padding
    (12, 3, [(0, 4), (4, 8), (8, 12)]),
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
    (3, 1, [(0, 3)]),
    (7, 2, [(0, 4), (4, 7)]),
])
def test_a_zero_partition_is_deepspeeds_equal_aligned_piece_of_the_flat_content(rows, world, pieces):
    """DeepSpeed pads a group's flat content to a multiple of 2 x world and cuts it into equal
    partitions (stage_1_and_2.py); the padding is local and never moves."""
    assert [held_rows(zero(world), rows, r) for r in range(world)] == pieces


@pytest.mark.parametrize("rows, old, new", [(n, a, b) for n in (1, 7, 16, 33) for a in (1, 2, 3, 4)
                                             for b in (1, 2, 3, 4)])
def test_zero_partitions_reshard_delivering_every_needed_item_once(rows, old, new):
    survivors = {r: r for r in range(min(old, new))}
    plan = ReshardPlan.make([spec(rows, zero(old))], old, new, survivors)
    assert plan.new_layouts == (zero(new),)
    for dst in range(new):
        got = sorted([(k.start, k.stop) for k in plan.keeps if k.new_rank == dst]
                     + [(m.start, m.stop) for m in plan.moves if m.dst == dst])
        assert [r for a, b in got for r in range(a, b)] == list(range(*plan.new_rows(0, dst)))
    assert plan.moved_bytes() == plan.minimum_bytes()


@pytest.mark.parametrize("layout, new_world, message", [
    (Layout((2, 2), (REPLICATE, zero_partition(2))), 4, r"a ZeRO partition needs a 1-D mesh"),
    (Layout((4,), ("ZeroPartition(align=0)",)), 4, r"ZeroPartition\(align=0\).*not supported"),
    (Layout((2,), ("Shard(dim=1)",)), 3, r"'w' with placement \[Shard\(dim=1\)\].*not supported"),
    (Layout((2,), ("Partial(sum)",)), 3, r"Partial\(sum\).*not supported"),
    (Layout((2, 2), (REPLICATE, SHARD0)), 3, r"world size 3 cannot take this mesh \(a multiple of 2"),
    (Layout((2, 2), (SHARD0, SHARD0)), 4, r"more than one mesh dimension"),
    (Layout((3,), (SHARD0,)), 2, r"the mesh holds 3 ranks, the group 4"),
])
def test_unmappable_layouts_are_refused_naming_tensor_and_placement(layout, new_world, message):
    with pytest.raises(ReshardError, match=message):
        ReshardPlan.make([spec(8, Layout.sharded(4), name="ok"), spec(8, layout)], 4, new_world,
                         {r: r for r in range(min(4, new_world))})


def test_bad_survivor_maps_are_refused():
    with pytest.raises(ReshardError, match="distinct"):
        ReshardPlan.make([], 2, 2, {0: 0, 1: 0})
    with pytest.raises(ReshardError, match="no rank stays"):
        ReshardPlan.make([], 2, 2, {})


@pytest.mark.parametrize("rows, old, new", [(n, a, b) for n in (0, 1, 5, 7, 16, 33) for a in (1, 2, 3, 4, 5)
                                             for b in (1, 2, 3, 4, 5)])
def test_every_needed_row_arrives_exactly_once(rows, old, new):
    survivors = {r: r for r in range(min(old, new))}
    plan = ReshardPlan.make([spec(rows, Layout.sharded(old))], old, new, survivors)
    for dst in range(new):
        got = sorted([(k.start, k.stop) for k in plan.keeps if k.new_rank == dst]
                     + [(m.start, m.stop) for m in plan.moves if m.dst == dst])
        covered = [r for a, b in got for r in range(a, b)]
        a, b = plan.new_rows(0, dst)
        assert covered == list(range(a, b))
    for m in plan.moves:
        a, b = plan.old_rows(0, m.src)
        assert a <= m.start < m.stop <= b
    assert plan.moved_bytes() == plan.minimum_bytes() and plan.relays == ()


@pytest.mark.parametrize("rows, old, new", [(n, a, b) for n in (1, 7, 16) for a in (2, 3, 4) for b in (2, 3, 4)])
def test_a_replacement_delivers_every_row_once_relaying_only_what_leaving_ranks_alone_held(rows, old, new):
    survivors = {r: r - 1 for r in range(1, min(old, new))}  # old rank 0 leaves, joiners take the top ranks
    plan = ReshardPlan.make([spec(rows, Layout.sharded(old))], old, new, survivors)
    for dst in range(new):
        got = sorted([(k.start, k.stop) for k in plan.keeps if k.new_rank == dst]
                     + [(m.start, m.stop) for m in (*plan.moves, *plan.relays) if m.dst == dst])
        assert [r for a, b in got for r in range(a, b)] == list(range(*plan.new_rows(0, dst)))
    for relay in plan.relays:
        assert relay.src not in survivors and relay.via in survivors and relay.dst not in survivors.values()
        assert plan.old_rows(0, relay.src)[0] <= relay.start < relay.stop <= plan.old_rows(0, relay.src)[1]
    assert plan.moved_bytes() == plan.minimum_bytes() + plan.relayed_bytes()


def test_transfer_rounds_keep_every_rank_within_one_bucket_and_the_plan_order():
    from spotguard.hooks.elastic.reshard_transfer import _pieces, _rounds, move_hops

    plan = ReshardPlan.make([spec(100, Layout.sharded(4), row_bytes=32), spec(7, Layout.sharded(4), row_bytes=4)],
                            4, 3, {0: 0, 1: 1, 2: 2})
    pieces = _pieces(plan, move_hops(plan, plan.moves, lambda old: old, lambda new: new), 160)
    assert all(p.stop - p.start <= 160 and (p.start - p.hop.start * plan.tensors[p.hop.tensor].row_bytes) % 16 == 0
               for p in pieces)
    assert sum(p.stop - p.start for p in pieces) == plan.moved_bytes()
    rounds = _rounds(pieces, 160)
    assert [p for r in rounds for p in r] == pieces
    for round_ in rounds:
        for rank in range(4):
            assert sum(p.stop - p.start for p in round_ if rank in (p.src, p.dst)) <= 160
