"""Which joiners the dry-run admits together (trainer.join_batch): one membership for the ones
ready close together, and a slow one holds the others back at most the window."""
from spotguard.trainer.join_batch import JoinBatch


def test_joiners_ready_together_are_admitted_in_one_membership():
    batch = JoinBatch(window=5.0)
    for node in ("node-1", "node-2", "node-3"):
        batch.started(node, 0.0)
    batch.ready("node-2", 3.0)
    assert batch.due(3.0) == []  # two started joiners are still expected
    batch.ready("node-1", 3.5)
    batch.ready("node-3", 4.0)
    assert batch.due(4.0) == ["node-1", "node-2", "node-3"]
    batch.admitted(batch.due(4.0))
    assert len(batch) == 0 and batch.due(4.1) == []


def test_a_slow_joiner_holds_the_others_back_at_most_the_window():
    batch = JoinBatch(window=5.0)
    batch.started("node-1", 0.0)
    batch.started("node-2", 0.0)
    batch.ready("node-1", 2.0)
    assert batch.due(6.9) == []
    assert batch.due(7.0) == ["node-1"]
    batch.admitted(["node-1"])
    batch.ready("node-2", 30.0)
    assert batch.due(30.0) == ["node-2"]  # the slow one comes with a later membership


def test_a_dropped_joiner_is_no_longer_waited_for():
    batch = JoinBatch(window=5.0)
    batch.started("node-1", 0.0)
    batch.started("node-2", 0.0)
    batch.ready("node-1", 1.0)
    batch.drop("node-2")  # reclaimed during its start-up, or it ended
    assert batch.due(1.0) == ["node-1"]
    batch.ready("node-2", 2.0)  # a late ready file of a dropped joiner admits nothing
    assert "node-2" not in batch and batch.due(2.0) == ["node-1"]
    assert sorted(batch.clear()) == ["node-1"] and len(batch) == 0


def test_a_joiner_started_much_later_does_not_hold_a_ready_one_back():
    batch = JoinBatch(window=5.0)
    batch.started("od-0", 0.0)  # a warm standby, at the notice
    batch.started("node-3", 8.0)  # a spot joiner asked for later: expected ready at 8 + 10 = 18
    batch.ready("od-0", 10.0)
    assert batch.due(10.0) == ["od-0"]
    batch.admitted(["od-0"])
    batch.started("node-1", 10.5)  # expected ready at 10.5 + 10: within node-3's window, it waits
    batch.ready("node-3", 18.0)
    assert batch.due(18.0) == []
